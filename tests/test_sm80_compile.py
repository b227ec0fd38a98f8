"""Every Triton kernel of kernels/ compiles for the A100 (sm_80), and the Gluon Hopper forward and backward
and FP8's quantizer (only Hopper runs them) for sm_90a, proven on any machine, GPU or not.

tests/sm80_compile.py compiles each kernel with triton.compile for GPUTarget("cuda", 80, 32) down to a cubin
(Triton's wheel carries ptxas; no CUDA driver is needed). Checked: no kernel is left out, each compiles,
its PTX targets sm_80 with no Hopper instruction (TMA, wgmma: Triton rewrites the attention's tensor
descriptors into pointer loads there), the attention products use mma.sync, and its shared memory fits an
A100's 163 KiB per block (else the launch would fail with OutOfResources). Integer arguments are compiled
as Triton specializes those of a launch at Llama's shapes (multiples of 16), and the attention kernels' also
unaligned (an odd length): ptxas crashed on a Hopper backward only when its length was known aligned. Runs
in a child process: this one runs Triton's interpreter, whose kernels cannot be compiled. About 20 s on 2
cores.
"""
import json
import os
import subprocess
import sys

import pytest
import triton

A100_SHARED_MEMORY_PER_BLOCK = 166912   # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_80
H100_SHARED_MEMORY_PER_BLOCK = 232448   # the same on sm_90
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _ptxas_available() -> bool:
    try:
        return "nvidia" in triton.backends.backends and os.access(triton.knobs.nvidia.ptxas.path, os.X_OK)
    except (RuntimeError, AttributeError, TypeError):
        return False


BACKWARD_SPILL_BYTES = 192


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no NVIDIA backend with ptxas")
def test_every_kernel_compiles_for_the_a100():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.pop("TRITON_OVERRIDE_ARCH", None)
    result = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "sm80_compile.py")], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {"uncovered_kernels": []}, "add the new kernel to tests/sm80_compile.py"
    compiled = lines[1:]
    assert len(compiled) >= 9
    for kernel in compiled:
        name = kernel["kernel"]
        assert "error" not in kernel, f"{name} does not compile for {kernel['target']}: {kernel.get('error')}"
        if kernel["target"] == "sm_90a" and "quantize_rows" in name:
            # FP8's quantizer (only Hopper runs it): compiles to Hopper's conversion to e4m3
            assert kernel["target_sm90a"] and kernel["cvt_e4m3"], kernel
            continue
        if kernel["target"] == "sm_90a":
            # warp-specialized (setmaxnreg), TMA and wgmma, within an H100's shared memory; no register spills
            # in the forward; the backward's few (76-184 bytes, with which it was measured) bounded so that
            # more cannot come silently
            assert "flash_attention_hopper" in name and kernel["target_sm90a"], kernel
            assert kernel["wgmma"] and kernel["tma"] and kernel["setmaxnreg"], kernel
            assert kernel["spill_bytes"] <= (BACKWARD_SPILL_BYTES if "backward" in name else 0), kernel
            assert kernel["shared_bytes"] <= H100_SHARED_MEMORY_PER_BLOCK, kernel
            continue
        assert kernel["target_sm80"] and not kernel["tma"] and not kernel["wgmma"], kernel
        assert kernel["shared_bytes"] <= A100_SHARED_MEMORY_PER_BLOCK, kernel
        if name.startswith("kernels.attention.") and "delta" not in name:
            assert kernel["mma_sync"], kernel
    assert {kernel["target"] for kernel in compiled} == {"sm_80", "sm_90a"}
    assert {kernel["variant"]["integers_aligned"] for kernel in compiled} == {True, False}
