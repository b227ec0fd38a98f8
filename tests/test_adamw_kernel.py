"""The fused AdamW kernel against `reference.adamw_update` (through Triton's interpreter on CPU tensors, or
compiled on the GPU under TRITON_INTERPRET=0), and the reference against torch.optim.AdamW; bf16 storage
rounds stochastically without bias."""
import tests.conftest_kernels  # noqa: F401  (interpreter or compiler settled before anything imports triton)

import pytest
import torch

from conf.capability import triton_interpreting
from kernels import reference
from kernels.adamw_update_triton import adamw_update

DEVICE = "cuda" if torch.cuda.is_available() and not triton_interpreting() else "cpu"
# Compiled Triton needs CUDA tensors; the interpreter takes CPU ones.
runs_the_kernel = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(),
                                     reason="compiled Triton without a CUDA GPU")

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def random_state(n, dtype, seed, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(n, generator=generator) for _ in range(3))
    exp_avg_sq = torch.rand(n, generator=generator)
    return [t.to(device, dtype) for t in (param, grad, exp_avg, exp_avg_sq)]


@runs_the_kernel
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_kernel_matches_reference(dtype, rtol):
    expected = random_state(3000, dtype, seed=1)           # not a multiple of the block: masked tail
    measured = [t.clone() for t in expected]
    reference.adamw_update(*expected, **HYPER, step=3, grad_scale=0.5)
    adamw_update(*measured, **HYPER, step=3, grad_scale=0.5)
    for name, ours, theirs in zip(("param", "grad", "exp_avg", "exp_avg_sq"), measured, expected):
        # fp32: atol at the tensor's scale; compiled, the kernel fuses multiply-adds that the reference rounds
        # twice, and an element near zero then differs by far more than rtol of itself (seen on the H100)
        scale = theirs.abs().max().item() if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol * scale, msg=lambda message: f"{name}: {message}")


def test_reference_is_torch_adamw():
    param, grad, exp_avg, exp_avg_sq = random_state(500, torch.float32, seed=2, device="cpu")
    torch_param = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([torch_param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                  eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    exp_avg.zero_(), exp_avg_sq.zero_()
    for step in (1, 2, 3):
        torch_param.grad = grad * step
        optimizer.step()
        reference.adamw_update(param, grad * step, exp_avg, exp_avg_sq, **HYPER, step=step)
    torch.testing.assert_close(param, torch_param.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, optimizer.state[torch_param]["exp_avg_sq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("update", [reference.adamw_update, pytest.param(adamw_update, marks=runs_the_kernel)],
                         ids=["reference", "triton"])
def test_bf16_updates_below_resolution_are_kept_in_expectation(update):
    """1.0 in bf16 has a resolution of 2^-7: a 1e-4 step is rounded away to nearest but survives on average."""
    n = 4096
    param = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    update(param, grad, exp_avg, exp_avg_sq, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
           step=1, seed=7)
    assert set(param.float().unique().tolist()) == {1.0 - 2**-8, 1.0}     # each rounded down or up
    assert param.float().mean().item() == pytest.approx(1.0 - 1e-4, abs=2e-5)


@pytest.mark.parametrize("update", [reference.adamw_update, pytest.param(adamw_update, marks=runs_the_kernel)],
                         ids=["reference", "triton"])
def test_a_shard_rounds_its_elements_as_the_whole_tensor_does(update):
    """A rank's shard of a parameter (FSDP2: a range of the flat tensor, from `first`) draws each element's
    rounding noise as the whole tensor does, so a sharded update is the unsharded one bit for bit."""
    whole = random_state(3000, torch.bfloat16, seed=3)
    shard = [t[1200:2100].clone() for t in whole]
    update(*whole, **HYPER, step=2, seed=11)
    update(*shard, **HYPER, step=2, seed=11, first=1200)
    for name, ours, theirs in zip(("param", "grad", "exp_avg", "exp_avg_sq"), shard, whole):
        assert torch.equal(ours, theirs[1200:2100]), name
    unaligned = [t[1200:2100].clone() for t in random_state(3000, torch.bfloat16, seed=3)]
    update(*unaligned, **HYPER, step=2, seed=11)
    assert not torch.equal(unaligned[0], whole[0][1200:2100])      # the offset is what lines the draws up
