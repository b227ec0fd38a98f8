"""Compile every Triton kernel of kernels/ for the A100 (sm_80), and the Gluon Hopper forward and backward
(kernels/attention/flash_attention_hopper*.py, which only Hopper runs) for sm_90a, on any machine:
no GPU, no CUDA driver.

Triton's wheel carries everything its NVIDIA backend needs (libtriton's MLIR/LLVM passes, libdevice, ptxas),
so `triton.compile` with an explicit GPUTarget("cuda", 80, 32) runs down to a cubin on a CPU-only host. It
must run in a process without TRITON_INTERPRET=1, under which `triton.jit` makes interpreter objects that
cannot be compiled; tests/test_sm80_compile.py starts this file so. Prints one JSON line per compile.

    python tests/sm80_compile.py                # each kernel once (attention: first candidate, no documents),
                                                # and the attention kernels also at odd lengths (23 compiles)
    python tests/sm80_compile.py --all-configs  # every attention candidate, with and without documents
                                                # (58 compiles, 3-6 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction

import kernels

(_row_norm, adamw_update, fa, fa_kernels, fa_hopper, fa_hopper_backward, layer_norm, linear_cross_entropy, rms_norm,
 rope, swiglu, quantize_rows, transpose) = (importlib.import_module(f"kernels.{name}") for name in
                  ("_row_norm", "adamw_update_triton", "attention.flash_attention", "attention.triton_kernels",
                   "attention.flash_attention_hopper", "attention.flash_attention_hopper_backward", "layer_norm_triton",
                   "linear_cross_entropy_triton", "rms_norm_triton", "rope_triton", "swiglu_triton",
                   "quantize_rows_triton", "transpose_triton"))
# Triton kernels that only Hopper runs (train.fp8 is refused below compute capability 9.0): compiled for sm_90a.
HOPPER_ONLY = (quantize_rows._quantize_rows_kernel,)

A100 = GPUTarget("cuda", 80, 32)
H100 = GPUTarget("cuda", 90, 32)
# The attention kernels' tensors: bf16 except the fp32 row statistics and the int32 document bounds.
ATTENTION_POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "DOC_START": "*i32", "DOC_END": "*i32", "DQ_ACC": "*fp32"}
ATTENTION_SCALARS = {"qk_scale_log2": "fp32", "sm_scale": "fp32"}
ATTENTION_SHAPE = {"GROUP": 4, "HEAD_DIM": 128, "CAUSAL": True}   # Llama-3 8B
NORM_TILE = _row_norm.row_config(4096, None)   # one row of a wide hidden size
HEAD_NORM_TILE = _row_norm.row_config(128, None)   # QK-norm's tiles of rows of one head


def _attention(fn, configs, all_configs: bool):
    """Each candidate config (or the first) without documents; with --all-configs also with documents."""
    return [(fn, {**ATTENTION_SHAPE, "HAS_DOCS": has_docs, **config.kwargs},
             dict(num_warps=config.num_warps, num_stages=config.num_stages), ATTENTION_POINTERS, ATTENTION_SCALARS)
            for config in (configs if all_configs else configs[:1])
            for has_docs in ((False, True) if all_configs else (False,))]


def _hopper_shapes(all_configs: bool) -> list[tuple[int, bool, bool]]:
    """(head dim, causal, documents): D=128 with and without documents and D=64; with --all-configs not causal."""
    return [(128, True, False), (128, True, True), (64, True, False)] + ([(128, False, True)] if all_configs else [])


def _hopper_forward(all_configs: bool):
    launch = dict(num_warps=4, maxnreg=fa_hopper.MAX_REGISTERS)
    return [(fa_hopper._attn_fwd_kernel, {"GROUP": 4, "HEAD_DIM": head_dim, "CAUSAL": causal, "HAS_DOCS": docs,
                                          "BLOCK_N": fa_hopper.BLOCK_N, "NUM_STAGES": fa_hopper.NUM_STAGES},
             launch, ATTENTION_POINTERS, ATTENTION_SCALARS) for head_dim, causal, docs in _hopper_shapes(all_configs)]


def _hopper_backward(all_configs: bool):
    launch = dict(num_warps=8, maxnreg=fa_hopper.MAX_REGISTERS)
    tiles = {"BLOCK_M": fa_hopper_backward.BLOCK_M, "BLOCK_N": fa_hopper_backward.BLOCK_N,
             "NUM_STAGES": fa_hopper_backward.NUM_STAGES}
    return [(fa_hopper_backward._attn_bwd_kernel,
             {"GROUP": 4, "HEAD_DIM": head_dim, "CAUSAL": causal, "HAS_DOCS": docs, **tiles},
             launch, ATTENTION_POINTERS, ATTENTION_SCALARS) for head_dim, causal, docs in _hopper_shapes(all_configs)]


def compile_jobs(all_configs: bool) -> list[tuple]:
    """(kernel, constexprs, options, pointer dtypes, scalar dtypes, integers aligned) per compile; a pointer not
    named takes bf16 (attention kernels: upper-case names; the others: names ending in _ptr), a scalar not
    named i32. Every kernel is compiled with its integer arguments known to be multiples of 16, as Triton
    specializes a launch at Llama's shapes (strides, lengths, head counts); the attention kernels' first
    configuration also without, as a launch at an odd length is compiled. Both matter: ptxas crashed on a
    Hopper backward only with its length aligned, and the sm_80 attention kernels take more shared memory
    aligned (c729dfe:docs/BENCHMARKS.md)."""
    odd_lengths = [fa_kernels._attn_fwd_kernel, fa_kernels._attn_bwd_dq_kernel, fa_kernels._attn_bwd_dkdv_kernel,
                   fa_hopper._attn_fwd_kernel, fa_hopper_backward._attn_bwd_kernel]
    jobs = _jobs(all_configs)
    return ([(*job, True) for job in jobs]
            + [(*next(job for job in jobs if job[0] is kernel), False) for kernel in odd_lengths])


def _jobs(all_configs: bool) -> list[tuple]:
    norm_backward = dict(BLOCK_R=NORM_TILE.block_r, BLOCK_H=NORM_TILE.block_h, CENTERED=True, COMPUTE_DX=True,
                         COMPUTE_DW=True, COMPUTE_DB=True)
    stats = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dw_partial_ptr": "*fp32", "db_partial_ptr": "*fp32"}
    return [
        *_attention(fa_kernels._attn_fwd_kernel, fa._FWD_CONFIGS, all_configs),
        *_attention(fa_kernels._attn_bwd_dq_kernel, fa._DQ_CONFIGS, all_configs),
        *_attention(fa_kernels._attn_bwd_dkdv_kernel, fa._DKDV_CONFIGS, all_configs),
        *_hopper_forward(all_configs),
        *_hopper_backward(all_configs),
        (fa_kernels._attn_bwd_delta_kernel, {"HEAD_DIM": 128, "BLOCK_M": 128}, {}, ATTENTION_POINTERS, {}),
        *[(rms_norm._rms_norm_forward_kernel, {"BLOCK_R": tile.block_r, "BLOCK_H": tile.block_h},
           {"num_warps": tile.num_warps}, stats, {"eps": "fp32"}) for tile in (NORM_TILE, HEAD_NORM_TILE)],
        (layer_norm._layer_norm_forward_kernel, {"BLOCK_R": NORM_TILE.block_r, "BLOCK_H": NORM_TILE.block_h,
                                                 "HAS_BIAS": True}, {"num_warps": NORM_TILE.num_warps}, stats,
         {"eps": "fp32"}),
        (_row_norm._row_norm_backward_kernel, norm_backward, {"num_warps": NORM_TILE.num_warps}, stats, {}),
        (_row_norm._row_norm_backward_kernel,
         norm_backward | {"BLOCK_R": HEAD_NORM_TILE.block_r, "BLOCK_H": HEAD_NORM_TILE.block_h, "CENTERED": False,
                          "COMPUTE_DW": False, "COMPUTE_DB": False},
         {"num_warps": HEAD_NORM_TILE.num_warps}, stats, {}),
        (linear_cross_entropy._cross_entropy_rows_kernel,
         {"BLOCK_V": linear_cross_entropy.BLOCK_V, "WRITE_GRAD": True}, {"num_warps": linear_cross_entropy.NUM_WARPS},
         {"targets_ptr": "*i64", "loss_ptr": "*fp32", "scale_ptr": "*fp32"}, {}),
        (rope._rope_kernel, {"BLOCK_HEADS": 32, "BLOCK_HALF": 64, "TRANSPOSE": False}, {"num_warps": 4}, {}, {}),
        (swiglu._swiglu_forward_kernel, {"BLOCK": swiglu.BLOCK}, {"num_warps": swiglu.NUM_WARPS}, {}, {}),
        (swiglu._swiglu_backward_kernel, {"BLOCK": swiglu.BLOCK}, {"num_warps": swiglu.NUM_WARPS}, {}, {}),
        (quantize_rows._quantize_rows_kernel,
         {"FP8_MAX": 448.0, "MIN_AMAX": 2.0 ** -100, "HAS_COLUMN_SCALE": True, "BLOCK_M": quantize_rows.BLOCK_M,
          "BLOCK_K": quantize_rows.BLOCK_K}, {"num_warps": quantize_rows.NUM_WARPS},
         {"column_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, {}),
        (transpose._transpose_kernel, {"BLOCK": transpose.BLOCK}, {"num_warps": transpose.NUM_WARPS},
         {"x_ptr": "*u8", "y_ptr": "*u8"}, {}),
        (adamw_update._adamw_kernel, {"BLOCK": adamw_update.BLOCK}, {}, {},
         dict.fromkeys(["grad_scale", "beta1", "beta2", "eps", "decay_factor", "step_size",
                        "bias_correction2_sqrt"], "fp32")),
    ]


def project_kernels() -> set[str]:
    """Every launched @triton.jit function (named *_kernel) defined in a module of kernels/ or its subpackages."""
    found = set()
    for module_info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            if (isinstance(value, JITFunction) and value.__name__.endswith("_kernel")
                    and value.fn.__module__ == module.__name__):
                found.add(f"{module.__name__}.{value.__name__}")
    return found


def _is_pointer(fn, name: str) -> bool:
    return name.endswith("_ptr") or (name.isupper() and fn.__module__ in (fa_kernels.__name__, fa_hopper.__name__,
                                                                           fa_hopper_backward.__name__))


def _spill_bytes(ptx: str, arch: str) -> int:
    """Bytes of register spill stores ptxas reports for the PTX (spills would slow a kernel silently)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        report = subprocess.run([triton.knobs.nvidia.ptxas.path, f"-arch={arch}", "-v", path, "-o",
                                 os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report.stdout + report.stderr))


def compile_for_its_gpu(all_configs: bool, index: int) -> dict:
    """The index-th job (jobs hold kernels, which do not pickle: a worker rebuilds the list), for sm_90a if
    it is a Gluon (Hopper) kernel or in HOPPER_ONLY, else for sm_80."""
    fn, constexprs, options, pointers, scalars, integers_aligned = compile_jobs(all_configs)[index]
    gluon = fn.is_gluon()
    hopper = gluon or fn in HOPPER_ONLY
    signature, attrs = {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("DOC_START", "DOC_END") and not constexprs.get("HAS_DOCS", True):
            signature[name], constexprs = "constexpr", {**constexprs, name: None}   # as a launch with None
        elif _is_pointer(fn, name):
            signature[name] = pointers.get(name, "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]   # as Triton specializes torch's aligned tensors
        else:
            signature[name] = scalars.get(name, "i32")
            if signature[name] == "i32" and integers_aligned and not (param.do_not_specialize
                                                                      or param.do_not_specialize_on_alignment):
                attrs[(index,)] = [["tt.divisibility", 16]]   # as Triton specializes a multiple of 16
    result = {"kernel": f"{fn.__module__}.{fn.__name__}", "target": "sm_90a" if hopper else "sm_80",
              "variant": {k: v for k, v in constexprs.items()
                          if k.startswith(("BLOCK", "HAS_DOCS", "HEAD_DIM", "CAUSAL"))} | options
              | {"integers_aligned": integers_aligned}}
    start = time.time()
    source = (GluonASTSource if gluon else ASTSource)(fn, signature, constexprs, attrs)
    try:
        compiled = triton.compile(source, target=H100 if hopper else A100, options=options)
    except Exception as error:   # reported per kernel: the test names the one that fails
        return result | {"error": f"{type(error).__name__}: {error}"[-3000:]}
    ptx = compiled.asm["ptx"]
    return result | {"seconds": round(time.time() - start, 1), "shared_bytes": compiled.metadata.shared,
                     "cubin_bytes": len(compiled.asm["cubin"]), "target_sm80": ".target sm_80" in ptx,
                     "target_sm90a": ".target sm_90a" in ptx, "mma_sync": "mma.sync" in ptx, "wgmma": "wgmma" in ptx,
                     "tma": "cp.async.bulk.tensor" in ptx or "tensormap" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
                     "cvt_e4m3": "e4m3" in ptx,
                     **({"spill_bytes": _spill_bytes(ptx, "sm_90a")} if hopper else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-configs", action="store_true")
    args = parser.parse_args()
    jobs = compile_jobs(args.all_configs)
    covered = {f"{fn.__module__}.{fn.__name__}" for fn, *_ in jobs}
    print(json.dumps({"uncovered_kernels": sorted(project_kernels() - covered)}), flush=True)
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        for result in pool.map(functools.partial(compile_for_its_gpu, args.all_configs), range(len(jobs))):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
