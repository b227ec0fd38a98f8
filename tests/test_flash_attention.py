"""Our attention (kernels/attention/: route.flash_attention) against kernels.reference.attention: forward and
every gradient.

CPU tests run the kernels through Triton's interpreter (fp32/fp16 only: the interpreter computes tl.dot on
bf16 operands wrongly) on small odd shapes. GPU tests run the compiled kernels in bf16 against the fp32
reference. Triton picks interpreter or compiler once per process, when it is imported: tests/conftest.py
picks the compiler on a CUDA machine unless TRITON_INTERPRET=1 is set, so there the GPU tests run and the
CPU tests skip.
"""
import conftest_kernels  # first: interpreter or compiler settled before triton loads

import math
import os
import subprocess
import sys
import threading

import pytest
import torch

from kernels import reference
from kernels.attention import attention_tape
from kernels.attention.attention_tape import AttentionTape
from kernels.attention.route import AttentionRoute, flash_attention

CUDA = torch.cuda.is_available()
interpreted = conftest_kernels.needs_interpreter
# fp32 through the interpreter is exact up to summation order; fp16 operands round to 11 bits.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3}


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(actual).any(), "NaN in result"
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def _inputs(batch, seqlen, q_heads, kv_heads, head_dim, dtype, device="cpu"):
    make = lambda heads: torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    return make(q_heads), make(kv_heads), make(kv_heads)


def _random_cu_seqlens(total: int, generator: torch.Generator) -> torch.Tensor:
    """Offsets of documents of random lengths 1..total covering the token axis, with an empty one too."""
    cuts = torch.randperm(total - 1, generator=generator)[: max(1, total // 12)] + 1
    offsets = torch.cat([torch.tensor([0, 0]), cuts.sort().values, torch.tensor([1, total])])
    return offsets.sort().values.to(torch.int32)


def _check_against_reference(q, k, v, causal, cu_seqlens=None, grad_out=None, tolerance=None):
    out = flash_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    grad_out = torch.randn_like(out) if grad_out is None else grad_out
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = reference.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens=cu_seqlens)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.float()) if q.dtype == torch.float32 else \
        _fp32_grads(q, k, v, causal, cu_seqlens, grad_out)
    tolerance = tolerance or TOLERANCE[q.dtype]
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert actual.shape == expected.shape and actual.dtype == q.dtype, name
        # e.g. dq, dk at S=1: softmax over one key has zero gradient, which the fp32 reference (PyTorch's
        # fused attention) gives up to rounding noise; unit-scale inputs give real gradients of order 0.1-1.
        if expected.abs().max() < 1e-6:
            assert actual.abs().max() < 1e-5, name
        else:
            assert _rel_err(actual, expected) < tolerance, (name, _rel_err(actual, expected))


def _fp32_grads(q, k, v, causal, cu_seqlens, grad_out):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=causal, cu_seqlens=cu_seqlens)
    return torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())


# (batch, seqlen, q_heads, kv_heads, head_dim, causal, dtype): S in {1, 17, 128, 200}, groups 1/4/8.
CASES = [
    (1, 1, 2, 2, 64, True, torch.float32),
    (2, 1, 4, 1, 128, False, torch.float32),
    (2, 17, 4, 1, 64, True, torch.float32),
    (1, 17, 8, 1, 64, False, torch.float16),
    (1, 128, 2, 2, 64, True, torch.float16),
    (1, 128, 8, 1, 64, True, torch.float32),
    (1, 200, 4, 1, 64, False, torch.float32),
    (1, 200, 2, 2, 128, True, torch.float32),
    (2, 130, 4, 1, 128, True, torch.float16),
]


@interpreted
@pytest.mark.parametrize("batch,seqlen,q_heads,kv_heads,head_dim,causal,dtype", CASES)
def test_matches_reference(batch, seqlen, q_heads, kv_heads, head_dim, causal, dtype):
    torch.manual_seed(seqlen * 7 + q_heads)
    _check_against_reference(*_inputs(batch, seqlen, q_heads, kv_heads, head_dim, dtype), causal)


@interpreted
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_documents_match_reference(causal, dtype):
    generator = torch.Generator().manual_seed(3 + causal)
    torch.manual_seed(11)
    batch, seqlen = 2, 75
    cu_seqlens = _random_cu_seqlens(batch * seqlen, generator)
    _check_against_reference(*_inputs(batch, seqlen, 4, 1, 64, dtype), causal, cu_seqlens)


@interpreted
@pytest.mark.parametrize("packed", [False, True])
def test_a_group_of_seven_query_heads_per_kv_head_matches_reference(packed):
    """Qwen2.5-7B's grouping (28 query over 4 KV heads: 7 a group, not a power of two), here 14 over 2: the dK/dV
    kernel sums the seven heads of its group, forward and backward, with packed documents too."""
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(7 + packed)
    batch, seqlen = 2, 37
    cu_seqlens = _random_cu_seqlens(batch * seqlen, generator) if packed else None
    _check_against_reference(*_inputs(batch, seqlen, 14, 2, 64, torch.float32), True, cu_seqlens)


@interpreted
def test_all_length_one_documents():
    torch.manual_seed(5)
    q, k, v = _inputs(1, 33, 2, 1, 64, torch.float32)
    _check_against_reference(q, k, v, True, torch.arange(34, dtype=torch.int32))


@interpreted
def test_strided_inputs_and_grad_out():
    """q/k/v as views of one fused projection and a transposed dO go through strides, without copies."""
    torch.manual_seed(9)
    batch, seqlen, q_heads, kv_heads, head_dim = 1, 40, 4, 2, 64
    fused = torch.randn(batch, seqlen, (q_heads + 2 * kv_heads) * head_dim, requires_grad=True)
    q, k, v = fused.view(batch, seqlen, q_heads + 2 * kv_heads, head_dim).split([q_heads, kv_heads, kv_heads], 2)
    grad_out = torch.randn(batch, q_heads, seqlen, head_dim).transpose(1, 2)
    assert not q.is_contiguous() and not grad_out.is_contiguous()
    out = flash_attention(q, k, v, causal=True)
    (grad,) = torch.autograd.grad(out, fused, grad_out)
    ref = reference.attention(q, k, v, causal=True)
    (ref_grad,) = torch.autograd.grad(ref, fused, grad_out)
    assert _rel_err(out, ref) < 2e-5 and _rel_err(grad, ref_grad) < 2e-5


@interpreted
def test_broadcast_grad_out():
    """out.sum() hands a stride-0 gradient."""
    torch.manual_seed(2)
    q, k, v = _inputs(1, 20, 2, 1, 64, torch.float32)
    flash_attention(q, k, v).sum().backward()
    ref_grads = torch.autograd.grad(reference.attention(q, k, v).sum(), (q, k, v))
    for actual, expected in zip((q.grad, k.grad, v.grad), ref_grads):
        assert _rel_err(actual, expected) < 2e-5


@interpreted
def test_softmax_scale():
    torch.manual_seed(4)
    q, k, v = _inputs(1, 24, 2, 1, 64, torch.float32)
    out = flash_attention(q, k, v, causal=False, softmax_scale=0.3)
    assert _rel_err(out, reference.attention(q, k, v, causal=False, softmax_scale=0.3)) < 2e-5


@pytest.mark.parametrize("make_args,error,match", [
    (lambda: _inputs(1, 8, 2, 1, 96, torch.float32), ValueError, "head dim 96"),
    (lambda: _inputs(1, 8, 2, 1, 64, torch.float64), TypeError, "dtype"),
    (lambda: _inputs(1, 8, 3, 2, 64, torch.float32), ValueError, "multiple"),
    (lambda: (*_inputs(1, 8, 2, 1, 64, torch.float32)[:2], torch.randn(1, 9, 1, 64)), ValueError, "mismatch"),
    (lambda: (torch.randn(1, 8, 2, 128)[..., ::2], *_inputs(1, 8, 2, 1, 64, torch.float32)[1:]), ValueError,
     "contiguous last dim"),
])
def test_launch_checks(make_args, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*make_args())


def test_bad_cu_seqlens():
    q, k, v = _inputs(1, 8, 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="end at"):
        flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 8]))


@interpreted
def test_cu_seqlens_are_checked_once_per_tensor_and_again_after_a_change(monkeypatch):
    """Checking cu_seqlens reads it to the host (on a GPU, a wait for all queued work): each layer of a step
    passes the same tensor, so it is checked, and its document bounds built, once; an in-place change is
    checked again, and a bad value still raises."""
    from kernels.attention import function
    checks = []
    original = function.check_cu_seqlens
    monkeypatch.setattr(function, "check_cu_seqlens", lambda *args: checks.append(1) or original(*args))
    q, k, v = _inputs(1, 24, 2, 1, 64, torch.float32)
    cu_seqlens = torch.tensor([0, 10, 24], dtype=torch.int32)
    first = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
    second = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
    assert len(checks) == 1 and torch.equal(first, second)
    cu_seqlens[1] = 5                        # other documents: checked again, and the output follows them
    moved = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
    assert len(checks) == 2 and not torch.equal(moved, first)
    _check_against_reference(q, k, v, True, cu_seqlens)
    cu_seqlens[1] = 30                       # decreasing: refused, not taken from the earlier check
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attention(q, k, v, cu_seqlens=cu_seqlens)


@interpreted
def test_inference_mode_cu_seqlens_are_checked_in_every_call(monkeypatch):
    """An inference-mode tensor has no version counter to tell an in-place change by: never cached."""
    from kernels.attention import function
    checks = []
    original = function.check_cu_seqlens
    monkeypatch.setattr(function, "check_cu_seqlens", lambda *args: checks.append(1) or original(*args))
    q, k, v = _inputs(1, 24, 2, 1, 64, torch.float32)
    with torch.inference_mode():
        cu_seqlens = torch.tensor([0, 10, 24], dtype=torch.int32)
        first = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
        cu_seqlens[1] = 5
        moved = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
    assert len(checks) == 2 and not torch.equal(moved, first)
    assert _rel_err(moved, reference.attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)) < 1e-5


@interpreted
def test_long_sequences_tune_once_on_a_prefix(monkeypatch):
    """Past TUNE_MAX_SEQLEN the tuning key stops growing, and the configs are tuned on a prefix of that
    length (seconds) instead of on the whole sequence (minutes at 524k); documents crossing the prefix
    end are cut there."""
    from kernels.attention import flash_attention as flash, function
    for module in (flash, function):
        monkeypatch.setattr(module, "TUNE_MAX_SEQLEN", 16)
    monkeypatch.setattr(function, "_tuned_on_prefix", set())
    assert flash._seq_bucket(9) == 16 and flash._seq_bucket(40) == 16
    q, k, v = (t.detach() for t in _inputs(1, 40, 2, 1, 64, torch.float32))
    doc_start, doc_end = function.document_bounds(torch.tensor([0, 10, 30, 40], dtype=torch.int32), 40)
    function._tune_on_prefix(AttentionRoute(), q, k, v, doc_start, doc_end, True, 0.125, "key")
    assert function._tuned_on_prefix == {"key"}
    monkeypatch.setattr(function, "triton_interpreting", lambda: False)
    assert not function._needs_prefix_tuning(40, "key") and function._needs_prefix_tuning(40, "other")
    assert not function._needs_prefix_tuning(16, "other")

@interpreted
def test_a_replayed_tape_gives_the_recorded_output_and_the_same_gradients():
    q, k, v = _inputs(2, 37, 4, 2, 64, torch.float32)
    grad_out = torch.randn(2, 37, 4, 64)
    tape = AttentionTape()
    with torch.no_grad(), tape.recording():
        recorded = flash_attention(q, k, v)
    assert len(tape.saved) == 1 and tape.saved[0][0].data_ptr() == recorded.data_ptr()
    with tape.replaying():
        replayed = flash_attention(q, k, v)
    assert replayed.data_ptr() == recorded.data_ptr(), "no new forward: the recorded output itself"
    grads = torch.autograd.grad(replayed, (q, k, v), grad_out)
    expected = torch.autograd.grad(flash_attention(q, k, v), (q, k, v), grad_out)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@interpreted
def test_a_replay_that_differs_from_the_recording_is_refused():
    q, k, v = _inputs(1, 8, 2, 2, 64, torch.float32)
    tape = AttentionTape()
    with torch.no_grad(), tape.recording():
        flash_attention(q, k, v)
    with tape.replaying(), pytest.raises(RuntimeError, match="replayed past"):
        flash_attention(q, k, v)
        flash_attention(q, k, v)
    shorter = _inputs(1, 7, 2, 2, 64, torch.float32)
    with tape.replaying(), pytest.raises(RuntimeError, match="differs from the recorded forward"):
        flash_attention(*shorter)
    with pytest.raises(RuntimeError, match="replayed 0 of its 1 recorded call"):
        with tape.replaying():
            pass


def test_a_tape_neither_takes_nor_answers_another_threads_calls():
    """Autograd runs a CUDA backward, where the checkpoint replays its tape, on a thread of its own; a
    tape in use on one thread must leave the attention calls of the others alone."""
    pair = (torch.zeros(1, 4, 2, 64), torch.zeros(1, 2, 4))
    answers = []

    def other_thread():
        attention_tape.record(*pair)
        answers.append(attention_tape.replayed(pair[0]))

    tape = AttentionTape()
    for context in (tape.recording, tape.replaying):
        with context():
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
    assert tape.saved == [] and answers == [None, None]


def test_a_pending_entry_is_resolved_by_the_call_that_replays_it():
    """A memory policy may hand the tape a copy still in flight as a callable: it is called when the attention
    call replaying it comes, not before, and the call gets its tensors."""
    pair = (torch.zeros(1, 4, 2, 64), torch.zeros(1, 2, 4))
    resolved = []
    tape = AttentionTape([tuple(lambda t=t: resolved.append(t) or t for t in pair)])
    with tape.replaying():
        assert resolved == []
        out, lse = attention_tape.replayed(pair[0])
    assert out is pair[0] and lse is pair[1] and len(resolved) == 2


def test_one_pass_statistics_are_padded_to_aligned_rows():
    """The one-pass backward reads each head's lse and delta rows by TMA, from 16-byte aligned addresses: at a
    length that is not a multiple of 4 floats they are copied with zero-padded rows; otherwise left as they are."""
    from kernels.attention.flash_attention_hopper_backward import STATS_ALIGN, _aligned_statistics
    lse, delta = torch.randn(2, 3, 65), torch.randn(2, 3, 65)
    padded_lse, padded_delta = _aligned_statistics(lse, delta)
    for padded, original in ((padded_lse, lse), (padded_delta, delta)):
        assert padded.shape == (2, 3, 68) and padded.is_contiguous()
        assert torch.equal(padded[..., :65], original) and not padded[..., 65:].any()
        assert padded.data_ptr() % 16 == 0 and padded.stride(1) % STATS_ALIGN.value == 0
    aligned_lse, aligned_delta = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    kept = _aligned_statistics(aligned_lse, aligned_delta)
    assert kept[0] is aligned_lse and kept[1] is aligned_delta


def test_the_hopper_forward_reads_rows_of_heads_and_launches_once_per_run_of_rows(monkeypatch):
    """The persistent Gluon forward reads q, k, v as [B * S, a token's heads] views: [B, S, H, D] layouts (heads
    apart or not) fit, [B, H, S, D] ones do not (the Triton forward takes them). Batch rows one after another
    go in one launch; rows apart, one launch each, on views of the output and statistics, not copies."""
    from kernels.attention import flash_attention_hopper
    tokens_first = torch.empty(2, 9, 4, 16)
    heads_apart = torch.empty(2, 9, 4, 32)[..., :16]
    heads_first = torch.empty(2, 4, 9, 16).transpose(1, 2)
    assert flash_attention_hopper.reads_as_rows(tokens_first, heads_apart)
    assert not flash_attention_hopper.reads_as_rows(tokens_first, heads_first)

    launches = []
    monkeypatch.setattr(flash_attention_hopper, "_launch", lambda q, k, v, out, lse, *rest: launches.append(
        (q.shape[0], q.data_ptr(), out, lse)))
    q, k = torch.randn(3, 9, 4, 16), torch.randn(3, 9, 2, 16)
    out, lse = flash_attention_hopper.attention_forward(q, k, k, None, None, True, 1.0)
    assert [(rows, ptr) for rows, ptr, *_ in launches] == [(3, q.data_ptr())]
    assert launches[0][2] is out and launches[0][3] is lse
    launches.clear()
    rows_apart = torch.randn(3, 12, 4, 16)[:, :9]
    out, lse = flash_attention_hopper.attention_forward(rows_apart, k, k, None, None, True, 1.0)
    assert [(rows, ptr) for rows, ptr, *_ in launches] == [(1, rows_apart[row].data_ptr()) for row in range(3)]
    for row, (_, _, row_out, row_lse) in enumerate(launches):
        assert row_out.data_ptr() == out[row].data_ptr() and row_lse.data_ptr() == lse[row].data_ptr()


@interpreted
def test_runs_after_kernels_and_model_were_imported():
    """The suite's order: other test modules import kernels and the model (no Triton yet) before this one."""
    script = (
        "import torch, kernels, model.decoder\n"
        "import tests.conftest_kernels\n"
        "kernels.set_backend('triton')\n"
        "q = torch.randn(1, 5, 2, 64, requires_grad=True)\n"
        "out = kernels.attention.attention(q, q.detach()[:, :, :1], q.detach()[:, :, 1:])\n"
        "out.sum().backward(); assert not q.grad.isnan().any(); print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    env.pop("TRITON_INTERPRET")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16, against the fp32 reference and against the same math done by PyTorch in bf16
# ------------------------------------------------------------------------------------------------------

gpu = conftest_kernels.needs_compiled_gpu


def _torch_attention_in_dtype(q, k, v, causal, cu_seqlens=None):
    """The reference's math without upcasting: PyTorch's own low-precision attention."""
    batch, seqlen, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    if cu_seqlens is not None:
        q, k, v = (t.reshape(1, batch * seqlen, *t.shape[2:]) for t in (q, k, v))
    qt = q.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (qt @ kt.transpose(-1, -2)) * head_dim ** -0.5
    total = qt.shape[2]
    allowed = torch.ones(total, total, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    if cu_seqlens is not None:
        doc = reference.document_ids(cu_seqlens, total)
        allowed &= doc[:, None] == doc[None, :]
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vt
    return out.transpose(1, 2).reshape(batch, seqlen, q_heads, head_dim)


# ‖out - ref‖/‖ref‖ that flash_attention's bf16 output and gradients must stay within: the errors measured on
# the H100 (docs/PERFORMANCE.md, "Attention"), plus 4.5-7%.
WHOLE_ROWS_ERRORS = {"out": 2.2e-3, "dq": 2.6e-3, "dk": 2.6e-3, "dv": 2.5e-3}
PACKED_ERRORS = {"out": 1.7e-3, "dq": 3.0e-3, "dk": 3.0e-3, "dv": 2.3e-3}


def _check_bf16_against_torch(batch, seqlen, q_heads, kv_heads, bounds, cu_seqlens=None):
    torch.manual_seed(seqlen)
    q, k, v = _inputs(batch, seqlen, q_heads, kv_heads, 128, torch.bfloat16, "cuda")
    out = flash_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
    grad_out = torch.randn_like(out)
    ours = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    lowp = _torch_attention_in_dtype(q, k, v, True, cu_seqlens)
    torch_bf16 = (lowp, *torch.autograd.grad(lowp, (q, k, v), grad_out))
    del lowp
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=True, cu_seqlens=cu_seqlens)
    exact = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad_out.float()))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, torch_bf16, exact):
        ours_err, torch_err = _rel_err(a, r), _rel_err(b, r)
        print(f"S={seqlen} {name}: flash_attention {ours_err:.2e}, torch bf16 {torch_err:.2e}")
        assert ours_err <= 2 * torch_err and ours_err <= bounds[name], (name, ours_err, torch_err, bounds[name])


@gpu
@pytest.mark.parametrize("seqlen,q_heads,kv_heads", [(4096, 32, 8), (16384, 4, 1)])
def test_gpu_bf16_error_within_twice_torch_bf16(seqlen, q_heads, kv_heads):
    _check_bf16_against_torch(1, seqlen, q_heads, kv_heads, WHOLE_ROWS_ERRORS)


@gpu
def test_gpu_packed_documents_bf16():
    cu_seqlens = _random_cu_seqlens(2 * 4096, torch.Generator().manual_seed(1)).cuda()
    _check_bf16_against_torch(2, 4096, 8, 2, PACKED_ERRORS, cu_seqlens)


@gpu
def test_gpu_deterministic():
    """deterministic=True: bit-identical gradients run to run. The default's may differ in the last bits where
    the one-pass backward runs (Hopper: dQ added by atomics), and dK/dV still agree with it closely."""
    torch.manual_seed(0)
    q, k, v = _inputs(1, 8192, 32, 8, 128, torch.bfloat16, "cuda")
    grad_out = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attention(q, k, v, deterministic=True), (q, k, v), grad_out)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    default = torch.autograd.grad(flash_attention(q, k, v), (q, k, v), grad_out)
    for fast, exact in zip(default, runs[0]):
        assert _rel_err(fast, exact) < 3e-3


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon backward is Hopper's")
@pytest.mark.skipif(os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80", reason="this process runs the A100 code")
@pytest.mark.parametrize("batch,seqlen,q_heads,kv_heads,head_dim,causal,dtype,packed,groups", [
    (1, 65, 2, 1, 128, True, torch.bfloat16, False, 1),        # one row past a tile
    (1, 1000, 4, 2, 128, True, torch.bfloat16, False, 1),      # a tail tile
    (2, 777, 4, 1, 64, True, torch.bfloat16, False, 1),        # D=64, a tail, the next batch row's heads after
    (1, 1500, 4, 2, 128, False, torch.bfloat16, False, 1),
    (1, 1500, 4, 2, 128, True, torch.float16, False, 1),
    (1, 4096, 32, 8, 128, True, torch.bfloat16, False, 1),
    (2, 2048, 4, 2, 128, True, torch.bfloat16, True, 1),
    (2, 1000, 8, 4, 128, True, torch.bfloat16, False, 4),      # four calls over groups of KV heads
    (1, 1001, 4, 2, 128, False, torch.bfloat16, True, 1),      # query tiles from any document start, odd length
    (1, 2000, 28, 4, 128, True, torch.bfloat16, False, 1),     # Qwen2.5-7B's heads: groups of seven
    (2, 1000, 14, 2, 128, True, torch.bfloat16, True, 1),      # groups of seven over packed documents
    (1, 1500, 24, 8, 128, True, torch.bfloat16, False, 1),     # Llama-3.2-3B's heads: groups of three
])
def test_gpu_hopper_backward_matches_the_reference(monkeypatch, batch, seqlen, q_heads, kv_heads, head_dim, causal,
                                                   dtype, packed, groups):
    """The one-pass Gluon backward (the default on Hopper) against the fp32 reference, no worse than the Triton
    two-kernel one (deterministic=True), over gradients' buffers poisoned with NaN; with a workspace cap that
    splits it over groups of KV heads too."""
    from kernels.attention import attention_workspace
    if groups > 1:
        whole = 4 * batch * seqlen * q_heads * head_dim
        monkeypatch.setattr(attention_workspace, "ONE_PASS_MAX_BYTES", whole // groups)
        assert attention_workspace.one_pass_head_groups(batch * seqlen, q_heads, kv_heads, head_dim) == groups
    torch.manual_seed(seqlen)
    q, k, v = _inputs(batch, seqlen, q_heads, kv_heads, head_dim, dtype, "cuda")
    cu_seqlens = _random_cu_seqlens(batch * seqlen, torch.Generator().manual_seed(3)).cuda() if packed else None
    _check_one_pass_backward(monkeypatch, q, k, v, causal, cu_seqlens)


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon backward is Hopper's")
@pytest.mark.skipif(os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80", reason="this process runs the A100 code")
@pytest.mark.parametrize("cu_seqlens", [None, [0, 300, 1000]])
def test_gpu_one_pass_backward_where_every_logit_is_very_negative(monkeypatch, cu_seqlens):
    """Non-causal rows whose every logit is about -120 (log-sum-exp below -88: exp(-lse) overflows fp32) over
    1,000 tokens, so the last key block crosses the end: the keys past it must be masked in every query tile,
    or their zero scores give P = inf there and dQ = dS K gets inf * 0 = NaN."""
    torch.manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(128, device="cuda"), dim=0)
    q, k, v = (t.detach() for t in _inputs(1, 1000, 4, 2, 128, torch.bfloat16, "cuda"))
    # q.k / sqrt(128) = -37 * 37 / 11.3 = -121, give or take the noise's ~4
    q = (q + 37 * direction).bfloat16().requires_grad_()
    k = (k - 37 * direction).bfloat16().requires_grad_()
    v.requires_grad_()
    # Every row's log-sum-exp below -88.7 (at most its largest logit + ln(1000 keys)): exp(-lse) overflows.
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, dim=2)) / 128 ** 0.5
    assert (logits.amax(-1) + math.log(1000)).max() < -88.7
    cu_seqlens = None if cu_seqlens is None else torch.tensor(cu_seqlens, device="cuda", dtype=torch.int32)
    _check_one_pass_backward(monkeypatch, q, k, v, False, cu_seqlens)


def _check_one_pass_backward(monkeypatch, q, k, v, causal, cu_seqlens):
    from kernels.attention import flash_attention_hopper_backward
    calls = []
    original = flash_attention_hopper_backward.attention_backward
    monkeypatch.setattr(flash_attention_hopper_backward, "attention_backward",
                        lambda *args: calls.append(1) or original(*args))
    grad_out = torch.randn_like(q)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference.attention(q32, k32, v32, causal=causal, cu_seqlens=cu_seqlens)
    exact = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    two_kernel = torch.autograd.grad(flash_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens,
                                                     deterministic=True), (q, k, v), grad_out)
    assert not calls
    # NaN in the blocks the caching allocator hands out next: the gradients' and the accumulator's buffers
    poison = [torch.full_like(t, float("nan")) for t in (q, k, v, q, q)]
    del poison
    one_pass = torch.autograd.grad(flash_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens), (q, k, v), grad_out)
    assert calls == [1]
    for name, ours, triton_grad, r in zip(("dq", "dk", "dv"), one_pass, two_kernel, exact):
        ours_err, triton_err = _rel_err(ours, r), _rel_err(triton_grad, r)
        print(f"{name}: one-pass {ours_err:.2e}, two-kernel {triton_err:.2e}")
        assert ours_err <= 1.05 * triton_err + 1e-6, (name, ours_err, triton_err)


@gpu
def test_gpu_compiled_code_is_the_architectures():
    """Hopper: TMA tile moves and wgmma products, the forward and the one-pass backward in warp-specialized
    Gluon kernels (setmaxnreg hands registers from their load warp to the others). Under
    TRITON_OVERRIDE_ARCH=sm80 (the process runs the code an A100 compiles): the Triton forward, no TMA, no
    wgmma, mma.sync products."""
    from kernels.attention import flash_attention as flash, flash_attention_hopper, flash_attention_hopper_backward
    device = torch.cuda.current_device()

    def compiled(fn):
        return [kernel.asm["ptx"] for kernel in fn.device_caches[device][0].values()]
    # What the Gluon forward holds after the call below was compiled for it: earlier tests may have filled it.
    flash_attention_hopper._attn_fwd_kernel.device_caches[device][0].clear()
    flash_attention_hopper_backward._attn_bwd_kernel.device_caches[device][0].clear()
    q, k, v = _inputs(1, 1024, 8, 2, 128, torch.bfloat16, "cuda")
    for deterministic in (True, False):
        torch.autograd.grad(flash_attention(q, k, v, deterministic=deterministic), (q, k, v), torch.randn_like(q))
    ptx = [code for tuned in flash._TUNED.values() for code in compiled(tuned.fn)]
    a100 = os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80"
    hopper = (compiled(flash_attention_hopper._attn_fwd_kernel)
              + compiled(flash_attention_hopper_backward._attn_bwd_kernel))
    if torch.cuda.get_device_capability()[0] == 9 and not a100:
        # dq and dk/dv in Triton (deterministic), the forward and the one-pass backward in Gluon
        assert len(ptx) >= 2 and len(hopper) == 2
        assert all("setmaxnreg" in code and "wgmma" in code for code in hopper)
    else:
        assert len(ptx) >= 3 and not hopper
    if torch.cuda.get_device_capability()[0] == 9 or a100:
        for code in ptx + hopper:
            assert ("mma.sync" in code) == a100 and ("wgmma" in code) != a100
            assert ("cp.async.bulk.tensor" in code) != a100


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon forward is Hopper's")
@pytest.mark.skipif(os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80", reason="this process runs the A100 code")
@pytest.mark.parametrize("batch,seqlen,q_heads,kv_heads,head_dim,causal,dtype,packed,layout", [
    (1, 1, 2, 1, 128, True, torch.bfloat16, False, "contiguous"),
    (1, 1000, 4, 2, 128, True, torch.bfloat16, False, "contiguous"),      # a tail tile
    (2, 777, 4, 1, 64, True, torch.bfloat16, False, "contiguous"),
    (1, 1500, 4, 2, 128, False, torch.bfloat16, False, "contiguous"),
    (1, 1500, 4, 2, 128, True, torch.float16, False, "contiguous"),
    (1, 8192, 32, 8, 128, True, torch.bfloat16, False, "contiguous"),
    (2, 2048, 4, 2, 128, True, torch.bfloat16, True, "contiguous"),
    # more work items than SMs: a CTA takes several, across batch rows and tail blocks, with documents too
    (2, 3000, 16, 4, 128, True, torch.bfloat16, False, "contiguous"),
    (1, 12000, 8, 2, 128, True, torch.bfloat16, True, "contiguous"),
    (2, 999, 4, 2, 128, True, torch.bfloat16, False, "heads apart"),    # slices of wider tensors (fused QKV)
    (3, 777, 4, 2, 128, False, torch.bfloat16, False, "rows apart"),    # one launch per batch row
    (1, 2000, 28, 4, 128, True, torch.bfloat16, True, "contiguous"),    # groups of seven (Qwen2.5-7B)
    (1, 1500, 24, 8, 128, True, torch.bfloat16, False, "contiguous"),   # groups of three (Llama-3.2-3B)
])
def test_gpu_hopper_forward_matches_the_triton_forward(monkeypatch, batch, seqlen, q_heads, kv_heads, head_dim,
                                                       causal, dtype, packed, layout):
    """The Gluon forward against the fp32 reference, no worse than the Triton forward it replaces, with the
    same log-sum-exp (which the backwards read), over a poisoned output buffer."""
    from kernels.attention import flash_attention as flash, flash_attention_hopper, function
    torch.manual_seed(seqlen)
    wider = {"contiguous": (seqlen, head_dim), "heads apart": (seqlen, 2 * head_dim),
             "rows apart": (seqlen + 123, head_dim)}[layout]
    q, k, v = (t.detach()[:, :seqlen, :, :head_dim]
               for t in _inputs(batch, wider[0], q_heads, kv_heads, wider[1], dtype, "cuda"))
    assert flash_attention_hopper.reads_as_rows(q, k, v)
    cu_seqlens = _random_cu_seqlens(batch * seqlen, torch.Generator().manual_seed(2)).cuda() if packed else None
    ref = reference.attention(q.float(), k.float(), v.float(), causal=causal, cu_seqlens=cu_seqlens)
    folded = [function._fold_batch(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v"))] if packed else [q, k, v]
    bounds = function.document_bounds(cu_seqlens, batch * seqlen) if packed else (None, None)
    flash.ensure_allocator(q.device)
    scale = head_dim ** -0.5
    # NaN in the blocks the caching allocator hands out next: the output's and the statistics' buffers
    poison = [torch.full_like(folded[0], float("nan")),
              torch.full((batch, q_heads, seqlen), float("nan"), device="cuda")]
    del poison
    out, lse = flash_attention_hopper.attention_forward(*folded, *bounds, causal, scale * flash.LOG2E)
    assert not torch.isnan(lse).any()
    triton_out, triton_lse = flash.forward(*folded, *bounds, causal, scale)
    ours, triton_err = _rel_err(out.view_as(ref), ref), _rel_err(triton_out.view_as(ref), ref)
    print(f"out error: Gluon {ours:.2e}, Triton {triton_err:.2e}")
    assert ours <= 1.05 * triton_err + 1e-6
    assert torch.allclose(lse, triton_lse, rtol=0, atol=1e-4)


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="the Gluon forward is Hopper's")
@pytest.mark.skipif(os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80", reason="this process runs the A100 code")
@pytest.mark.parametrize("batch,seqlen,q_heads,kv_heads,head_dim,causal", [
    (2, 3000, 16, 4, 128, True),     # rounds across KV heads and batch rows, a tail block
    (1, 5000, 8, 2, 128, True),      # an odd number of runs of blocks
    (2, 1500, 8, 1, 64, False),      # one KV head: runs of blocks of each batch row
])
def test_gpu_hopper_forward_gives_the_same_bits_in_either_order_of_work_items(monkeypatch, batch, seqlen, q_heads,
                                                                              kv_heads, head_dim, causal):
    """Work items KV head by KV head (runs of blocks in alternating directions), as long rows take them, or
    heads fastest: each item is computed alone, so the outputs and statistics are the same bits, and none is
    NaN although the memory they are written to held NaN (an item left out would leave it there)."""
    from kernels.attention import flash_attention as flash, flash_attention_hopper
    torch.manual_seed(seqlen)
    q, k, v = (t.detach() for t in _inputs(batch, seqlen, q_heads, kv_heads, head_dim, torch.bfloat16, "cuda"))
    flash.ensure_allocator(q.device)
    results = []
    for kv_major_blocks in (0, 2 ** 30):     # KV head by KV head at every length; at none
        monkeypatch.setattr(flash_attention_hopper, "KV_MAJOR_BLOCKS", kv_major_blocks)
        # Freed to the caching allocator, which hands the same blocks to the outputs allocated next.
        poison = [torch.full_like(q, float("nan")), torch.full((batch, q_heads, seqlen), float("nan"), device="cuda")]
        del poison
        results.append(flash_attention_hopper.attention_forward(q, k, v, None, None, causal,
                                                                head_dim ** -0.5 * flash.LOG2E))
    (out, lse), (heads_first_out, heads_first_lse) = results
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, heads_first_out) and torch.equal(lse, heads_first_lse)


@gpu
@pytest.mark.skipif(os.environ.get("TRITON_OVERRIDE_ARCH") == "sm80", reason="this process runs the A100 code")
@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability()[0] < 9, reason="the default path is the A100's")
def test_gpu_a100_code_path_on_this_gpu():
    """The GPU tests again in a process whose kernels Triton compiles as for an A100 (TRITON_OVERRIDE_ARCH
    applies per process: compiled kernels are cached in memory without it in their key)."""
    env = {**os.environ, "TRITON_OVERRIDE_ARCH": "sm80"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "gpu_bf16 or gpu_packed or gpu_compiled"], capture_output=True, text=True, env=env,
                            timeout=900)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@interpreted
def test_a_second_order_gradient_is_an_error_not_silently_zero():
    """The kernels' backward is not itself differentiable: differentiating through its result must raise."""
    q, k, v = _inputs(1, 9, 2, 2, 64, torch.float32)
    dq, = torch.autograd.grad(flash_attention(q, k, v).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()
