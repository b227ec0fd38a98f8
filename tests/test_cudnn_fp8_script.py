"""scripts/experiments/cudnn_fp8_attention.py on CPU: its FLOP count, the per-tensor E4M3 scales it hands cuDNN
(from amax), the quantize/dequantize round trip with them, its argument checks, its hard time limit, and its one-line
exit on a machine without CUDA. The cuDNN graphs themselves need a Hopper GPU (gpu_session.sh's cudnn_fp8 step)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "experiments" / "cudnn_fp8_attention.py"
spec = importlib.util.spec_from_file_location("cudnn_fp8_attention", SCRIPT)
fp8_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fp8_script)


def run_script(code_or_args: list[str]) -> subprocess.CompletedProcess:
    # No GPU visible even on the GPU machine (where this file runs too): the script must refuse, not measure.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *code_or_args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_causal_flops_count_half_the_square_and_the_backward_as_two_and_a_half_forwards():
    seqlen = 8192
    forward = fp8_script.causal_flops(seqlen, backward=False)
    assert forward == 2 * seqlen * seqlen * 32 * 128          # 2 matmuls x 2 FLOPs x S^2/2 x heads x D
    assert fp8_script.causal_flops(seqlen, backward=True) == 3.5 * forward
    assert fp8_script.causal_flops(2 * seqlen, backward=False) == 4 * forward
    assert fp8_script.tflops(forward, 1.0) == pytest.approx(forward / 1e9)      # ms -> TFLOP/s
    assert fp8_script.tflops(forward, None) is None


@pytest.mark.parametrize("amax, scale", [(448.0, 1.0), (2.0, 224.0), (1e-3, 448e3), (896.0, 0.5)])
def test_scale_takes_amax_to_the_e4m3_maximum_and_descale_undoes_it(amax, scale):
    got_scale, got_descale = fp8_script.fp8_scales(torch.tensor(amax))
    assert got_scale.shape == got_descale.shape == (1, 1, 1, 1) and got_scale.dtype == torch.float32
    assert got_scale.item() == pytest.approx(scale, rel=1e-6)
    assert got_descale.item() == pytest.approx(1 / scale, rel=1e-6)
    assert fp8_script.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max == 448


@pytest.mark.parametrize("amax", [0.0, float("nan"), float("inf")])
def test_a_tensor_without_a_finite_nonzero_amax_gets_scale_one(amax):
    scale, descale = fp8_script.fp8_scales(torch.tensor(amax))
    assert scale.item() == 1.0 and descale.item() == 1.0


def test_a_subnormal_amax_gets_a_finite_scale():
    scale, descale = fp8_script.fp8_scales(torch.tensor(1e-40))
    assert torch.isfinite(scale).all() and descale.item() > 0


def test_quantize_dequantize_round_trips_within_e4m3_precision():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, 4, 128, generator=generator) * 3
    x[0, 0, 0, :8] = torch.tensor([1e-4, -2e-4, 5e-3, 0.0, 1e-6, -1e-6, 0.05, -0.05])     # small values too
    scale, descale = fp8_script.fp8_scales(x.abs().amax())
    q = fp8_script.quantize(x.to(torch.bfloat16), scale)
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().abs().max().item() == 448          # the amax lands on the format's maximum, not past it
    back = fp8_script.dequantize(q, descale)
    x_bf16 = x.to(torch.bfloat16).float()
    # E4M3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value; below its smallest normal (2^-6) the
    # step is the subnormal one, 2^-9, in scaled units.
    bound = 2.0 ** -4 * x_bf16.abs() + 2.0 ** -10 * descale.item()
    assert ((back - x_bf16).abs() <= bound * (1 + 1e-6)).all()
    assert fp8_script.rel_err(back, x_bf16) < 0.05
    zeros = torch.zeros(3, 8)
    scale, descale = fp8_script.fp8_scales(zeros.abs().amax())
    assert fp8_script.dequantize(fp8_script.quantize(zeros, scale), descale).eq(0).all()


def test_quantize_clamps_what_a_stale_scale_would_push_past_the_range():
    # A delayed scale from a step with a smaller amax: torch's E4M3 cast would give NaN past the range.
    q = fp8_script.quantize(torch.tensor([1.0, -3.0, 2.0]), torch.tensor(448.0).reshape(1, 1, 1, 1))
    assert q.float().tolist() == [448.0, -448.0, 448.0]


def test_bhsd_strides_read_our_bshd_tensors_in_place():
    t = torch.empty(1, 256, 8, 128)
    dims, strides = fp8_script.bhsd(1, 8, 256, 128)
    view = t.transpose(1, 2)
    assert dims == tuple(view.shape) and strides == view.stride()


@pytest.mark.parametrize("bad, words", [(["--seqlens", "1000"], "--seqlens takes multiples of 128"),
                                         (["--time-limit-s", "0"], "--time-limit-s must be positive"),
                                         (["--rounds", "0"], "--rounds must be at least 1"),
                                         (["--ref-kv-heads", "9"], "--ref-kv-heads must be between 0 and 8")])
def test_arguments_are_checked_before_anything_runs(bad, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        fp8_script.parse_args(bad)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_default_arguments():
    args = fp8_script.parse_args([])
    assert args.seqlens == [8192, 32768, 131072] and args.time_limit_s > 0 and args.ref_kv_heads == 1
    assert args.deterministic_check and args.json is None


def test_without_cuda_the_script_exits_with_one_line_naming_what_it_needs(tmp_path):
    out = tmp_path / "fp8.jsonl"
    done = run_script([str(SCRIPT), "--seqlens", "128", "--json", str(out)])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "cudnn_fp8_attention.py needs a CUDA GPU (Hopper or newer for cuDNN's FP8 attention): none is visible"]
    assert not out.exists()


def test_the_time_limit_ends_the_process_wherever_it_is():
    code = (f"import importlib.util, time; spec = importlib.util.spec_from_file_location('m', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "m.start_watchdog(0.5, {'case': 'S=131072'}); time.sleep(60); print('not reached')")
    done = run_script(["-c", code])
    assert done.returncode == 124
    assert "time limit of 0.5 s reached during S=131072: exiting" in done.stdout and "not reached" not in done.stdout


def test_a_cudnn_refusal_keeps_each_engines_reason_on_one_line():
    refusal = RuntimeError("\n".join([
        "No valid engine configs for graph", '{"engineId":0}', "Warning: NOT_SUPPORTED; Reason: fp8 I/O",
        "Warning: NOT_SUPPORTED; Reason: finalize_internal()", '{"engineId":2}',
        "Warning: Reason: this->libcuda == nullptr", "Warning: Reason: ptr->isSupported()", ""]))
    assert fp8_script.short(refusal) == ('RuntimeError: No valid engine configs for graph | {"engineId":0} | Warning: '
                                         'NOT_SUPPORTED; Reason: fp8 I/O | {"engineId":2} | Warning: Reason: '
                                         'this->libcuda == nullptr')
    assert len(fp8_script.short(RuntimeError("x" * 5000))) == len("RuntimeError: ") + 2000
