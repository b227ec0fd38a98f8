"""kernels/attention/route.py: which attention runs in every case, the same choices the dispatch made before
the route was a value (the planner's candidates, the reference where our kernels do not run, cuDNN's backward
for whole rows and ours for packed ones, the Gluon kernels where they read the inputs), on any machine: a
GPU's answers are asked of the functions that give them."""
import dataclasses

import pytest
import torch

import kernels
from conf.capability import NO_GPU, GpuCapability, gpu_capability
from kernels import reference
from kernels.attention import AttentionRoute, attention, candidates, choose_route, route
from kernels.attention import flash_attention_hopper

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
H100 = GpuCapability("NVIDIA H100 80GB HBM3", (9, 0), hopper=True, fp8=True, cudnn_attention_backward=True)
A100 = GpuCapability("NVIDIA A100-SXM4-80GB", (8, 0))


def this_machines_gpu(monkeypatch, gpu: GpuCapability) -> None:
    """The route asks conf.capability what this machine's GPU runs (tests/test_capability.py tests its answers)."""
    monkeypatch.setattr(route, "gpu_capability", lambda device: gpu if device.type == "cuda" else NO_GPU)


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    kernels.set_backend("auto")


def _choices(routes):
    return tuple((r.forward, r.backward) for r in routes)


@pytest.mark.parametrize("backend, deterministic, gpu, expected", [
    ("auto", False, "h100_80gb", (("gluon", "cudnn"), ("gluon", "triton"))),   # Hopper: cuDNN's backward first
    ("auto", False, "h200", (("gluon", "cudnn"), ("gluon", "triton"))),
    ("auto", True, "h100_80gb", (("gluon", "triton"),)),       # cuDNN's backward adds dQ with atomics
    ("triton", False, "h100_80gb", (("gluon", "triton"),)),    # our kernels throughout
    ("auto", False, "a100_80gb", (("triton", "triton"),)),     # an A100: ours
    ("reference", False, "h100_80gb", (("reference", "reference"),)),
])
def test_the_planner_tries_cudnn_first_where_it_runs(monkeypatch, backend, deterministic, gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)      # planning for a named GPU
    assert _choices(candidates(CUDA, 128, backend, deterministic, planned_gpu=gpu_capability(gpu))) == expected
    on_cpu = "reference" if backend != "triton" else "triton"
    assert (_choices(candidates(CPU, 128, backend, deterministic, planned_gpu=gpu_capability(gpu)))
            == ((on_cpu, on_cpu),))


@pytest.mark.parametrize("gpu, expected", [
    (H100, ("gluon", "cudnn")),
    (dataclasses.replace(H100, cudnn_attention_backward=False), ("gluon", "triton")),   # cuDNN disabled or absent
    (dataclasses.replace(H100, hopper=False), ("triton", "cudnn")),    # Triton compiling the A100's code there
    (A100, ("triton", "triton")),
])
def test_this_machines_gpu_decides_when_none_is_named(monkeypatch, gpu, expected):
    this_machines_gpu(monkeypatch, gpu)
    chosen = choose_route(CUDA, 128, "auto")
    assert (chosen.forward, chosen.backward) == expected and chosen.falls_back and chosen.records
    assert choose_route(CUDA, 128, "auto", cudnn_fits=False).backward == "triton"


@pytest.mark.parametrize("backend, device, head_dim, dtype, forward, records", [
    ("reference", CUDA, 128, None, "reference", False),
    ("auto", CPU, 128, None, "reference", False),
    ("auto", CUDA, 128, None, "triton", True),
    ("auto", CUDA, 16, None, "reference", False),             # the tiny model's head dim
    ("auto", CUDA, 64, torch.float32, "triton", True),
    ("auto", CUDA, 64, torch.float64, "reference", False),
    ("triton", CPU, 64, None, "triton", True),                # Triton's interpreter
    ("triton", CUDA, 16, None, "triton", False),              # our kernels refuse it at the first call
])
def test_our_kernels_run_where_they_take_the_shape_else_the_reference_under_auto(monkeypatch, backend, device,
                                                                                 head_dim, dtype, forward, records):
    this_machines_gpu(monkeypatch, A100)
    chosen = choose_route(device, head_dim, backend, dtype=dtype)
    assert chosen.forward == forward and chosen.records == records
    assert chosen.falls_back == (backend == "auto")


def test_deterministic_keeps_our_two_kernel_backward_on_hopper(monkeypatch):
    this_machines_gpu(monkeypatch, H100)
    chosen = choose_route(CUDA, 128, "auto", deterministic=True)
    assert (chosen.forward, chosen.backward, chosen.deterministic) == ("gluon", "triton", True)


@pytest.mark.parametrize("here, planned, expected", [
    (H100, "a100_80gb", ("gluon", "triton")),     # the plan counted no cuDNN workspace
    (A100, "h100_80gb", ("triton", "cudnn")),     # the plan counted one, and this GPU has no Gluon forward
])
def test_a_named_gpu_decides_the_backward_and_this_machines_the_forward(monkeypatch, here, planned, expected):
    """memory.gpu naming another GPU than the one visible: the backward is the one whose workspace the plan
    counted; the forward is what this GPU runs."""
    this_machines_gpu(monkeypatch, here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    chosen = choose_route(CUDA, 128, "auto", planned_gpu=gpu_capability(planned))
    assert (chosen.forward, chosen.backward) == expected


def _packed(head_dim=16):
    q = torch.randn(1, 4, 2, head_dim)
    return q, torch.tensor([0, 4], dtype=torch.int32)


@pytest.mark.parametrize("job, fits, backward", [
    (AttentionRoute("gluon", "cudnn"), True, "gluon"),        # packed rows of a cuDNN plan: the one-pass backward
    (AttentionRoute("gluon", "cudnn"), False, "triton"),      # ... where its accumulator fits the plan's workspace
    (AttentionRoute("gluon", "cudnn", deterministic=True), True, "triton"),
    (AttentionRoute("gluon", "triton"), True, "triton"),      # a plan for our kernels counted no workspace
])
def test_rows_cudnn_does_not_take_run_our_backward(monkeypatch, job, fits, backward):
    monkeypatch.setattr(route, "_one_pass_fits", lambda q, k: fits)
    q, cu_seqlens = _packed()
    call = job.for_call(q, q, cu_seqlens)
    assert (call.forward, call.backward) == ("gluon", backward)


def test_a_call_runs_the_implementation_its_route_names(monkeypatch):
    """attention() sends our routes to our autograd function with the call's route, the reference's to the
    reference, and kernels=auto's calls on tensors our kernels do not take (a CPU tensor) to the reference."""
    from kernels.attention import function
    seen = []
    monkeypatch.setattr(function.FlashAttentionFunction, "apply", lambda *args: seen.append(args[-1]) or args[0])
    q, cu_seqlens = _packed()
    attention(q, q, q, AttentionRoute("gluon", "cudnn"), cu_seqlens=cu_seqlens)
    assert [(r.forward, r.backward) for r in seen] == [("gluon", "gluon")]
    for job in (AttentionRoute("reference", "reference"), AttentionRoute("gluon", "cudnn", falls_back=True)):
        out = attention(q, q, q, job, cu_seqlens=cu_seqlens)
        torch.testing.assert_close(out, reference.attention(q, q, q, cu_seqlens=cu_seqlens), rtol=0, atol=0)
    assert len(seen) == 1


def test_a_model_without_a_route_runs_the_ops_backend(monkeypatch):
    """No build installed a route (tests, tools): the route `choose_route` gives for the tensor under
    kernels.set_backend, with no cuDNN workspace planned."""
    from kernels.attention import function
    seen = []
    monkeypatch.setattr(function.FlashAttentionFunction, "apply", lambda *args: seen.append(args[-1]) or args[0])
    q = torch.randn(1, 4, 2, 64)
    kernels.set_backend("reference")
    torch.testing.assert_close(attention(q, q, q), reference.attention(q, q, q), rtol=0, atol=0)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")      # set_backend("triton") then runs without a GPU
    kernels.set_backend("triton")
    attention(q, q, q)
    assert [(r.forward, r.backward, r.falls_back) for r in seen] == [("triton", "triton", False)]


def test_sequence_parallel_routes_run_ulysses_over_their_group(monkeypatch):
    from kernels.attention import sequence_parallel
    calls = []

    def ulysses(run, q, k, v, group, **options):
        calls.append(group)
        return run(q, k, v, **options)
    monkeypatch.setattr(sequence_parallel, "ulysses_attention", ulysses)
    q = torch.randn(1, 4, 2, 16)
    group = object()
    out = attention(q, q, q, AttentionRoute("reference", "reference", sequence_group=group))
    assert calls == [group] and torch.equal(out, reference.attention(q, q, q))


@pytest.mark.parametrize("job, takes, aligned, forward", [
    (AttentionRoute("gluon", "cudnn"), True, True, "gluon"),
    (AttentionRoute("gluon", "cudnn"), True, False, "cudnn"),     # descriptors need 16-byte alignment
    (AttentionRoute("gluon", "cudnn"), False, True, "cudnn"),     # a layout or GPU the Gluon kernel lacks
    (AttentionRoute("gluon", "gluon"), True, False, "gluon"),
    (AttentionRoute("gluon", "triton"), False, True, "triton"),
    (AttentionRoute("triton", "triton"), True, True, "triton"),
])
def test_the_gluon_forward_runs_where_the_route_names_it_and_it_reads_the_inputs(monkeypatch, job, takes, aligned,
                                                                                 forward):
    monkeypatch.setattr(flash_attention_hopper, "takes", lambda q, k, v: takes)
    monkeypatch.setattr(route, "tma_compatible", lambda t: aligned)
    q = torch.randn(1, 8, 2, 64)
    assert job.forward_runs(q, q, q) == forward


@pytest.mark.parametrize("job, supports, broadcast, backward", [
    (AttentionRoute("gluon", "gluon"), True, False, "gluon"),
    (AttentionRoute("gluon", "gluon"), True, True, "triton"),     # dO from out.sum(): stride 0
    (AttentionRoute("gluon", "gluon"), False, False, "triton"),   # not a Hopper GPU, or not 16-bit
    (AttentionRoute("gluon", "triton"), True, False, "triton"),
])
def test_the_one_pass_backward_runs_where_the_route_names_it_and_it_reads_do(monkeypatch, job, supports, broadcast,
                                                                             backward):
    monkeypatch.setattr(flash_attention_hopper, "supports", lambda q: supports)
    q = torch.randn(1, 8, 2, 64)
    do = torch.ones(()).expand_as(q) if broadcast else torch.randn_like(q)
    assert job.backward_runs(q, do) == backward


@pytest.mark.parametrize("kv_heads, v_dtype, message", [(3, torch.bfloat16, "multiple of key/value heads"),
                                                       (2, torch.float16, "share one dtype")])
def test_the_cudnn_path_checks_shapes_before_the_gluon_forward(kv_heads, v_dtype, message):
    """Where its forward is the Gluon kernel, which reads K/V heads as q_heads // kv_heads, inputs it cannot
    take are refused with our kernels' message before it runs."""
    from kernels.attention import cudnn_attention
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, kv_heads, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=message):
        cudnn_attention._forward(q, k, k.to(v_dtype), True, 0.125, "gluon")


def test_a_route_names_known_implementations():
    with pytest.raises(ValueError, match="not 'sdpa'"):
        AttentionRoute("sdpa", "triton")
