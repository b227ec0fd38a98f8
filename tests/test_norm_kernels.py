"""Triton RMSNorm and LayerNorm (kernels/rms_norm_triton.py, kernels/layer_norm_triton.py) on CPU through Triton's
interpreter, against the fp32 reference: forward and every gradient, fp32 and fp16, odd shapes.
(bf16 runs on the GPU only: tests/test_kernels_gpu.py.)"""
import conftest_kernels  # first: interpreter or compiler settled before any kernels.* Triton module loads
from conftest_kernels import poisoned_empty  # noqa: F401  (fixture)

import zlib

import pytest
import torch

import kernels
from kernels import _row_norm, reference
from kernels.layer_norm_triton import layer_norm
from kernels.rms_norm_triton import rms_norm

pytestmark = conftest_kernels.needs_interpreter

# Leading shapes of every rank, hidden sizes from 3 to 16384 that are mostly not powers of two.
SHAPES = [(1, 3), (1, 8), (3, 5, 33), (17, 64), (2, 3, 100), (4, 1000), (2, 16384)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
EPS = 1e-5


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) values"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def norm_case(op_name: str, shape, dtype, with_bias: bool):
    """Random inputs, our outputs and gradients, and the fp32 reference's, for one norm call."""
    hidden = shape[-1]
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    params = [(1 + 0.5 * torch.randn(hidden)).to(dtype).requires_grad_()]
    if op_name == "layer_norm":
        params.append((0.5 * torch.randn(hidden)).to(dtype).requires_grad_() if with_bias else None)
    ours, ref = (rms_norm, reference.rms_norm) if op_name == "rms_norm" else (layer_norm, reference.layer_norm)
    dy = torch.randn(shape, dtype=dtype)
    y = ours(x, *params, EPS)
    y.backward(dy)
    ref_inputs = [None if p is None else p.detach().float().requires_grad_() for p in (x, *params)]
    y_ref = ref(*ref_inputs, EPS)
    y_ref.backward(dy.float())
    pairs = [(y, y_ref)] + [(p.grad, r.grad) for p, r in zip((x, *params), ref_inputs) if p is not None]
    return pairs


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("op_name,with_bias", [("rms_norm", False), ("layer_norm", True), ("layer_norm", False)])
def test_forward_and_gradients_match_reference(poisoned_empty, op_name, with_bias, shape, dtype):
    torch.manual_seed(zlib.crc32(repr((op_name, shape)).encode()))
    for out, ref in norm_case(op_name, shape, dtype, with_bias):
        assert out.dtype == ref.dtype or out.dtype == dtype
        assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("op_name", ["rms_norm", "layer_norm"])
def test_launch_tuning_arguments_keep_the_results(op_name):
    """num_warps and backward_programs_per_sm (what scripts/bench_kernels.py sweeps) reach the launches:
    a larger backward grid gives other row ranges per program, the same values."""
    torch.manual_seed(4)
    x, w, b = torch.randn(203, 24, requires_grad=True), torch.randn(24, requires_grad=True), torch.randn(24)
    args = (x, w, EPS) if op_name == "rms_norm" else (x, w, b, EPS)
    ours, ref = (rms_norm, reference.rms_norm) if op_name == "rms_norm" else (layer_norm, reference.layer_norm)
    y = ours(*args, num_warps=2, backward_programs_per_sm=16)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    y_ref = ref(*args)
    dx_ref, dw_ref = torch.autograd.grad(y_ref.sum(), (x, w))
    for out, expected in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("op_name", ["rms_norm", "layer_norm"])
def test_strided_rows_expanded_gradient_and_fp32_weight(op_name):
    """x viewed out of a wider buffer (row stride 2H), dy from .sum() (stride 0), fp32 weight on fp16 x."""
    torch.manual_seed(1)
    hidden = 48
    x = torch.randn(6, 2 * hidden, dtype=torch.float16)[:, :hidden].requires_grad_()
    w = torch.randn(hidden, requires_grad=True)
    args = (x, w, EPS) if op_name == "rms_norm" else (x, w, None, EPS)
    ours, ref = (rms_norm, reference.rms_norm) if op_name == "rms_norm" else (layer_norm, reference.layer_norm)
    y = ours(*args)
    y.float().sum().backward()
    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = ref(x_ref, w_ref, EPS) if op_name == "rms_norm" else ref(x_ref, w_ref, None, EPS)
    y_ref.sum().backward()
    assert y.dtype == torch.float16 and w.grad.dtype == torch.float32
    for out, expected in ((y, y_ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        assert relative_error(out, expected) < 2e-3


@pytest.mark.parametrize("frozen", ["x", "weight"])
def test_only_the_needed_gradients(frozen):
    torch.manual_seed(2)
    x = torch.randn(9, 40, requires_grad=frozen != "x")
    w = torch.randn(40, requires_grad=frozen != "weight")
    b = torch.randn(40, requires_grad=True)
    for y, y_ref in ((rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS)),
                     (layer_norm(x, w, b, EPS), reference.layer_norm(x, w, b, EPS))):
        ours = torch.autograd.grad(y.sum(), [t for t in (x, w) if t.requires_grad])
        expected = torch.autograd.grad(y_ref.sum(), [t for t in (x, w) if t.requires_grad])
        for out, ref in zip(ours, expected):
            assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("weight_trained", [False, True])
def test_rows_of_one_head_go_many_to_a_program(weight_trained):
    """QK-norm's rows (head_dim 128 of every head, here 3 x 37 x 5 = 555: no multiple of the tile's rows): tiles
    of several rows in the forward and in both backwards, one tile a program when the weight is frozen (LoRA),
    ranges of tiles summing dweight when it trains."""
    assert _row_norm.row_config(128, None).block_r > 1
    torch.manual_seed(6)
    x = torch.randn(3, 37, 5, 128, requires_grad=True)
    w = (1 + 0.5 * torch.randn(128)).requires_grad_(weight_trained)
    dy = torch.randn_like(x)
    inputs = [t for t in (x, w) if t.requires_grad]
    ours = (rms_norm(x, w, EPS), *torch.autograd.grad(rms_norm(x, w, EPS), inputs, dy))
    ref_inputs = [t.detach().requires_grad_(t.requires_grad) for t in (x, w)]
    y_ref = reference.rms_norm(*ref_inputs, EPS)
    expected = (y_ref, *torch.autograd.grad(y_ref, [t for t in ref_inputs if t.requires_grad], dy))
    assert len(ours) == 2 + weight_trained
    for out, ref in zip(ours, expected):
        assert relative_error(out, ref) < 1e-5


def test_backward_grid_splits_rows_into_ranges():
    """More rows than backward programs: every program sums a range of rows into its partial."""
    programs, rows_per_program = _row_norm.backward_grid(203, torch.device("cpu"),
                                                        _row_norm.BACKWARD_PROGRAMS_PER_SM)
    assert programs * rows_per_program >= 203 > (programs - 1) * rows_per_program and rows_per_program > 1
    torch.manual_seed(3)
    for out, ref in norm_case("layer_norm", (203, 24), torch.float32, with_bias=True):
        assert relative_error(out, ref) < 1e-5


def test_dispatch_runs_triton_when_asked():
    kernels.set_backend("triton")
    try:
        x, w = torch.randn(3, 16), torch.randn(16)
        assert relative_error(kernels.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS)) < 1e-5
        assert relative_error(kernels.layer_norm(x, w, None, EPS), reference.layer_norm(x, w, None, EPS)) < 1e-5
    finally:
        kernels.set_backend("auto")


def test_clear_errors():
    w = torch.randn(8)
    with pytest.raises(ValueError, match="one row stride"):
        rms_norm(torch.randn(8, 5).t(), torch.randn(8), EPS)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        rms_norm(torch.ones(2, 8, dtype=torch.int32), w, EPS)
    with pytest.raises(ValueError, match="contiguous \\[8\\] vector"):
        layer_norm(torch.randn(2, 8), torch.randn(7), None, EPS)
    with pytest.raises(ValueError, match="exceeds the supported maximum"):
        rms_norm(torch.randn(1, _row_norm.MAX_HIDDEN + 1), torch.randn(_row_norm.MAX_HIDDEN + 1), EPS)
    with pytest.raises(ValueError, match="at least one row"):
        rms_norm(torch.randn(0, 8), w, EPS)
