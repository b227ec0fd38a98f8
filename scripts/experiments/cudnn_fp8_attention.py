"""cuDNN's FP8 attention (the cuDNN frontend's `sdpa_fp8` and `sdpa_fp8_backward` graphs) against our bf16
kernels on a Hopper GPU, issue 48's first measurement: speed and error side by side, in one run.

    python3 scripts/experiments/cudnn_fp8_attention.py [--seqlens 8192 32768 131072] [--json PATH]
        [--time-limit-s 540] [--rounds 3] [--ref-kv-heads 1]

Causal, batch 1, 32 query and 8 KV heads of 128, our [batch, seq, heads, head_dim] layout (cuDNN reads it through
strides, no copies). q, k, v and dO are quantized to E4M3 with one scale per tensor (E4M3_MAX / amax: what the graphs
take, as descale factors); the softmax probabilities with the fixed scale E4M3_MAX (they lie in [0, 1]). The
output, dQ, dK and dV scales are calibrated from the amax values cuDNN returns (delayed scaling, as a training
step would carry them over), then every graph runs once more for the checks. The first configuration whose
forward and backward graphs both build wins, in this order: output dtype bf16 then E4M3 (the frontend takes a bf16
O, dQ, dK, dV from FP8 inputs on Blackwell only: on Hopper they come in E4M3, dequantized here), native GQA then K/V
expanded to 32 heads, the causal mask as a diagonal bound then as the older use_causal_mask flag; each refusal is
printed and kept in the JSON.

Errors are ||x - ref|| / ||ref|| against fp32 attention of the bf16 inputs (kernels.reference.attention, which runs
PyTorch's fused attention in fp32) on the first --ref-kv-heads KV heads and their query heads, for cuDNN's
dequantized output and gradients and for ours (kernels.attention.route.flash_attention) on the same inputs.
Timings: CUDA events, a warm-up call, then the median over rounds taken in turn (docs/PERFORMANCE.md, "How to
measure"); cuDNN both as its graphs alone (inputs already FP8) and with the casts a bf16 model needs around them
(amax, quantize, dequantize, as unfused torch ops: an upper bound of what they cost). TFLOP/s count causal FLOPs as
bench_attention.py does: forward 2*2*S^2/2*heads*D, backward 2.5x the forward (FlashAttention's count), so
forward+backward is 3.5x. One JSON line per length appended to --json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

import torch

from conf.capability import gpu_capability

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
E4M3_MAX = 448.0        # torch.finfo(torch.float8_e4m3fn).max
FORWARD_BACKWARD_FLOPS_FACTOR = 3.5
WHEELS_HINT = "bash ../shared/device/wheels.sh liger-kernel==0.8.5 nvidia-cudnn-frontend==1.32.0"
# uids of the graphs' tensors: the variant packs bind buffers by them.
FORWARD_UIDS = {name: uid for uid, name in enumerate(
    ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
     "o", "stats", "amax_s", "amax_o"), start=1)}
BACKWARD_UIDS = {name: uid for uid, name in enumerate(
    ("q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO",
     "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP",
     "dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP"), start=101)}
MASKS = ("diagonal_bound", "use_causal_mask")


def causal_flops(seqlen: int, backward: bool, q_heads: int = Q_HEADS, head_dim: int = HEAD_DIM) -> float:
    """Causal attention FLOPs of one row of `seqlen` tokens (bench_attention.py's count)."""
    forward = 2.0 * 2.0 * seqlen * seqlen / 2 * q_heads * head_dim
    return forward * (FORWARD_BACKWARD_FLOPS_FACTOR if backward else 1.0)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / ms / 1e9


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, descale) as [1, 1, 1, 1] fp32 tensors on amax's device, computed there (no host sync): scale takes
    amax to E4M3_MAX; a tensor with no finite nonzero amax (all zeros) gets 1."""
    amax = amax.detach().float().reshape(1, 1, 1, 1)
    usable = torch.isfinite(amax) & (amax > 0)
    # The clamp keeps E4M3_MAX / amax finite for a subnormal amax.
    scale = torch.where(usable, E4M3_MAX / amax.clamp(min=2.0 ** -100), torch.ones_like(amax))
    return scale, 1.0 / scale


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale in E4M3 (torch's cast turns values past the format's range into NaN: clamped first)."""
    return (x.float() * scale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return x.float() * descale.reshape(())


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


# Lines that cuDNN repeats under every engine's refusal: dropped, so that each engine's reason fits the line.
REFUSAL_BOILERPLATE = ("finalize_internal()", "ptr->isSupported()", "CUDNN_STATUS_NOT_INITIALIZED == status",
                       "check_for_support()", "process_knob_choices()")


def short(error: BaseException, limit: int = 2000) -> str:
    """An exception in one line of at most `limit` characters, without cuDNN's repeated lines."""
    lines = [" ".join(line.split()) for line in str(error).splitlines()]
    text = " | ".join(line for line in lines if line and not any(b in line for b in REFUSAL_BOILERPLATE))
    return f"{type(error).__name__}: {text[:limit]}"


# ---------------------------------------------------------------- cuDNN graphs
# Each graph gets the handle: without one the frontend looks the device up through cuda-python, which the GPU
# image lacks (the backend's path needs nothing else from it).

def bhsd(batch: int, heads: int, seqlen: int, head_dim: int) -> tuple[tuple, tuple]:
    """cuDNN's (B, H, S, D) dims and the strides of our contiguous [B, S, H, D] tensor."""
    return (batch, heads, seqlen, head_dim), (seqlen * heads * head_dim, head_dim, heads * head_dim, 1)


def mask_arguments(cudnn, mask: str) -> dict:
    """The causal mask as the frontend's preferred diagonal bound, or as its older (deprecated) flag."""
    if mask == "diagonal_bound":
        return {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0}
    return {"use_causal_mask": True}


def _scalar(cudnn, graph, uids: dict, name: str):
    return graph.tensor(uid=uids[name], name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1),
                        data_type=cudnn.data_type.FLOAT)


def _set_output(tensor, uid: int, dims, strides, data_type) -> None:
    tensor.set_uid(uid).set_output(True).set_dim(dims).set_stride(strides).set_data_type(data_type)


def _finish(cudnn, graph):
    """Validate and build the graph's plans; a refusal raises (cudnn.cudnnGraphNotSupportedError or another)."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def _fp8_graph(cudnn, handle, uids: dict, seqlen: int, kv_heads: int):
    """An FP8 graph with fp32 math and its E4M3 q, k, v of one row: (graph, q, k, v, q's dims and strides)."""
    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    q_dims, q_strides = bhsd(1, Q_HEADS, seqlen, HEAD_DIM)
    kv_dims, kv_strides = bhsd(1, kv_heads, seqlen, HEAD_DIM)
    q = graph.tensor(uid=uids["q"], name="q", dim=q_dims, stride=q_strides, data_type=fp8)
    k = graph.tensor(uid=uids["k"], name="k", dim=kv_dims, stride=kv_strides, data_type=fp8)
    v = graph.tensor(uid=uids["v"], name="v", dim=kv_dims, stride=kv_strides, data_type=fp8)
    return graph, q, k, v, q_dims, q_strides


def forward_graph(cudnn, handle, seqlen: int, kv_heads: int, out_type, mask: str):
    """sdpa_fp8 over E4M3 q, k, v of one row: output O in out_type, Stats (fp32 log-sum-exp), Amax_S, Amax_O."""
    fp32 = cudnn.data_type.FLOAT
    u = FORWARD_UIDS
    graph, q, k, v, q_dims, q_strides = _fp8_graph(cudnn, handle, u, seqlen, kv_heads)
    scalars = {name: _scalar(cudnn, graph, u, name)
               for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    o, stats, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, **scalars, generate_stats=True,
                                              attn_scale=HEAD_DIM ** -0.5, name="sdpa_fp8",
                                              **mask_arguments(cudnn, mask))
    _set_output(o, u["o"], q_dims, q_strides, out_type)
    _set_output(stats, u["stats"], (1, Q_HEADS, seqlen, 1), (Q_HEADS * seqlen, seqlen, 1, 1), fp32)
    # Amax_S is deprecated (scale_s is fixed by P's bound) but declared, as the frontend's FP8 tests do.
    _set_output(amax_s, u["amax_s"], (1, 1, 1, 1), (1, 1, 1, 1), fp32)
    _set_output(amax_o, u["amax_o"], (1, 1, 1, 1), (1, 1, 1, 1), fp32)
    return _finish(cudnn, graph)


def backward_graph(cudnn, handle, seqlen: int, kv_heads: int, out_type, mask: str, deterministic: bool = False):
    """sdpa_fp8_backward: E4M3 q, k, v, dO; O in out_type (the forward's); dQ, dK, dV in out_type, and the amax
    of dQ, dK, dV and dP."""
    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    u = BACKWARD_UIDS
    graph, q, k, v, q_dims, q_strides = _fp8_graph(cudnn, handle, u, seqlen, kv_heads)
    kv_dims, kv_strides = bhsd(1, kv_heads, seqlen, HEAD_DIM)
    o = graph.tensor(uid=u["o"], name="o", dim=q_dims, stride=q_strides, data_type=out_type)
    d_o = graph.tensor(uid=u["dO"], name="dO", dim=q_dims, stride=q_strides, data_type=fp8)
    stats = graph.tensor(uid=u["stats"], name="stats", dim=(1, Q_HEADS, seqlen, 1),
                         stride=(Q_HEADS * seqlen, seqlen, 1, 1), data_type=fp32)
    scalars = {name: _scalar(cudnn, graph, u, name)
               for name in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                            "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")}
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = graph.sdpa_fp8_backward(
        q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **scalars, attn_scale=HEAD_DIM ** -0.5,
        use_deterministic_algorithm=deterministic, name="sdpa_fp8_backward", **mask_arguments(cudnn, mask))
    _set_output(dq, u["dQ"], q_dims, q_strides, out_type)
    _set_output(dk, u["dK"], kv_dims, kv_strides, out_type)
    _set_output(dv, u["dV"], kv_dims, kv_strides, out_type)
    for tensor, name in ((amax_dq, "amax_dQ"), (amax_dk, "amax_dK"), (amax_dv, "amax_dV"), (amax_dp, "amax_dP")):
        _set_output(tensor, u[name], (1, 1, 1, 1), (1, 1, 1, 1), fp32)
    return _finish(cudnn, graph)


def configurations(cudnn) -> list[dict]:
    """The configurations tried, best first (module docstring)."""
    return [{"out_dtype": out_name, "out_type": out_type, "kv_heads": kv_heads, "mask": mask}
            for out_name, out_type in (("bf16", cudnn.data_type.BFLOAT16), ("e4m3", cudnn.data_type.FP8_E4M3))
            for kv_heads in (KV_HEADS, Q_HEADS) for mask in MASKS]


def choose_graphs(cudnn, handle, seqlen: int, failures: list):
    """(configuration, forward graph, backward graph or None) of the first configuration whose forward and
    backward both build, else of the first whose forward builds; (None, None, None) if none. Each refusal is
    printed and appended to `failures`."""
    forward_only = None
    for config in configurations(cudnn):
        label = f"{config['out_dtype']} out, {config['kv_heads']} KV heads, {config['mask']}"
        args = (cudnn, handle, seqlen, config["kv_heads"], config["out_type"], config["mask"])
        try:
            forward = forward_graph(*args)
        except Exception as error:
            failures.append({"config": label, "graph": "forward", "error": short(error)})
            print(f"  refused, forward ({label}): {short(error)}", flush=True)
            continue
        try:
            return config, forward, backward_graph(*args)
        except Exception as error:
            failures.append({"config": label, "graph": "backward", "error": short(error)})
            print(f"  refused, backward ({label}): {short(error)}", flush=True)
            forward_only = forward_only or (config, forward, None)
    return forward_only or (None, None, None)


# ---------------------------------------------------------------- running the graphs

class Fp8Attention:
    """One length's cuDNN FP8 graphs with their buffers: execute by uid from bf16 q, k, v and dO."""

    def __init__(self, handle, config: dict, forward, backward, q, k, v, grad_out):
        self.handle, self.config = handle, config
        self.forward_graph, self.backward_graph = forward, backward
        self.expanded = config["kv_heads"] != k.shape[2]
        self.fp8_out = config["out_dtype"] == "e4m3"
        out_dtype = torch.float8_e4m3fn if self.fp8_out else torch.bfloat16
        device = q.device
        scalar = lambda value=1.0: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)  # noqa: E731
        self.buffers = {name: scalar() for name in (
            "descale_q", "descale_k", "descale_v", "scale_q", "scale_k", "scale_v", "scale_dO", "descale_dO",
            "amax_s", "amax_o", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")}
        b = self.buffers
        b["scale_s"], b["descale_s"] = scalar(E4M3_MAX), scalar(1.0 / E4M3_MAX)
        for name in ("scale_o", "descale_o", "scale_dQ", "scale_dK", "scale_dV", "scale_dP", "descale_dP"):
            b[name] = scalar()
        b["o"] = torch.empty(q.shape, dtype=out_dtype, device=device)
        b["stats"] = torch.empty(1, Q_HEADS, q.shape[1], 1, dtype=torch.float32, device=device)
        kv_shape = (*k.shape[:2], self.config["kv_heads"], HEAD_DIM)
        for name, shape in (("dQ", q.shape), ("dK", kv_shape), ("dV", kv_shape)):
            b[name] = torch.empty(shape, dtype=out_dtype, device=device)
        self.bf16 = {"q": q, "k": k, "v": v, "dO": grad_out}
        self.quantize_inputs(("q", "k", "v", "dO"))
        if self.fp8_out:   # |O| <= max|V| (a convex combination of V's rows): a first scale that cannot overflow
            self._rescale("amax_v", "scale_o", "descale_o")
        self.forward_pack = {uid: b[name] for name, uid in FORWARD_UIDS.items()}
        self.forward_workspace = self.workspace(forward)
        if backward is not None:
            self.backward_pack = {uid: b[name] for name, uid in BACKWARD_UIDS.items()}
            self.backward_workspace = self.workspace(backward)

    def workspace(self, graph) -> torch.Tensor:
        return torch.empty(max(int(graph.get_workspace_size()), 1), dtype=torch.uint8, device=self.buffers["o"].device)

    def quantize_inputs(self, names=("q", "k", "v")) -> None:
        """These bf16 inputs to E4M3 with scales from their amax, on the GPU (no host sync); K/V repeated to the
        graph's heads where it runs without GQA."""
        b = self.buffers
        for name in names:
            x = self.bf16[name]
            if self.expanded and name in ("k", "v"):
                x = x.repeat_interleave(Q_HEADS // x.shape[2], dim=2)
            amax = x.abs().amax()
            b[f"amax_{name}"] = amax
            scale, descale = fp8_scales(amax)
            b[f"scale_{name}"].copy_(scale)
            b[f"descale_{name}"].copy_(descale)
            b[name] = quantize(x, scale)
        for pack, uids in ((getattr(self, "forward_pack", None), FORWARD_UIDS),
                           (getattr(self, "backward_pack", None), BACKWARD_UIDS)):
            if pack is not None:    # the new FP8 tensors replace the old ones in the packs
                pack.update({uids[name]: b[name] for name in names if name in uids})

    def forward(self) -> None:
        self.forward_graph.execute(self.forward_pack, self.forward_workspace, handle=self.handle)

    def backward(self) -> None:
        self.backward_graph.execute(self.backward_pack, self.backward_workspace, handle=self.handle)

    def forward_with_casts(self) -> torch.Tensor:
        """What a bf16 model would run: quantize q, k, v, the graph, O back to bf16."""
        self.quantize_inputs()
        self.forward()
        return self.output().to(torch.bfloat16)

    def forward_backward_with_casts(self) -> tuple:
        """forward_with_casts, then quantize dO, the backward graph, dQ, dK, dV back to bf16."""
        self.forward_with_casts()
        self.quantize_inputs(("dO",))
        self.backward()
        return tuple(g.to(torch.bfloat16) for g in self.gradients())

    def output(self) -> torch.Tensor:
        b = self.buffers
        return dequantize(b["o"], b["descale_o"]) if self.fp8_out else b["o"].float()

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV in fp32, dK and dV summed over each KV head's query heads where K/V were expanded."""
        b = self.buffers
        grads = [dequantize(b[n], 1.0 / b[f"scale_{n}"]) if self.fp8_out else b[n].float() for n in ("dQ", "dK", "dV")]
        if self.expanded:
            group = Q_HEADS // KV_HEADS
            grads[1:] = [g.view(*g.shape[:2], KV_HEADS, group, HEAD_DIM).sum(3) for g in grads[1:]]
        return tuple(grads)

    def _rescale(self, amax: str, scale: str, descale: str | None = None) -> None:
        value, inverse = fp8_scales(self.buffers[amax])
        self.buffers[scale].copy_(value)
        if descale is not None:
            self.buffers[descale].copy_(inverse)

    def calibrate(self) -> dict:
        """Set the output and gradient scales from the amax cuDNN returns, as delayed scaling would carry them
        over from a step before: O's after one forward, dP's after one backward (it quantizes dS = P * (dP - D)
        inside), dQ, dK and dV's after one with dP's scale set; then the forward and backward once more.
        Returns every amax and scale."""
        self.forward()
        if self.fp8_out:
            self._rescale("amax_o", "scale_o", "descale_o")
        self.forward()
        if self.backward_graph is not None:
            self.backward()
            self._rescale("amax_dP", "scale_dP", "descale_dP")
            self.backward()
            if self.fp8_out:
                for name in ("dQ", "dK", "dV"):
                    self._rescale(f"amax_{name}", f"scale_{name}")
            self.backward()
        torch.cuda.synchronize()
        names = ["amax_q", "amax_k", "amax_v", "amax_s", "amax_o", "scale_o"]
        if self.backward_graph is not None:
            names += ["amax_dO", "amax_dP", "amax_dQ", "amax_dK", "amax_dV", "scale_dP", "scale_dQ", "scale_dK",
                      "scale_dV"]
        return {name: float(self.buffers[name].float().reshape(-1)[0]) for name in names}


# ---------------------------------------------------------------- the run

def median_ms(calls: dict, rounds: int, target_ms: float) -> dict:
    """{name: median ms of one call} for calls {name: function of no arguments}, timed in turn, round after
    round; each timing repeats a call enough times to last about target_ms. A call that raises is reported and
    left out."""
    import experiment_timing  # this script's folder

    reps, times = {}, {}
    for name, call in calls.items():
        try:
            call()                      # warm-up: compiling, plan caches
            torch.cuda.synchronize()
            reps[name] = max(1, math.ceil(target_ms / max(experiment_timing.milliseconds(call, 1), 1e-3)))
            times[name] = []
        except Exception as error:
            print(f"  {name}: {short(error)}", flush=True)
    for _ in range(rounds):
        for name in times:
            times[name].append(experiment_timing.milliseconds(calls[name], reps[name]))
    return {name: statistics.median(runs) for name, runs in times.items()}


def reference_subset(q, k, v, grad_out, kv_heads: int):
    """fp32 attention of the first kv_heads KV heads and their query heads: (out, dq, dk, dv). K and V are
    repeated to the query heads inside the autograd graph (their gradients sum back): PyTorch's fp32 fused
    attention (the memory-efficient one) then runs without GQA, and no S x S matrix is made past 16k tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import reference
    group = Q_HEADS // KV_HEADS
    leaves = [t[:, :, :heads].float().requires_grad_() for t, heads in
              ((q, kv_heads * group), (k, kv_heads), (v, kv_heads))]
    q32, k32, v32 = leaves[0], *(t.repeat_interleave(group, dim=2) for t in leaves[1:])
    backends = [SDPBackend.EFFICIENT_ATTENTION] + ([SDPBackend.MATH] if q.shape[1] <= 16384 else [])
    with sdpa_kernel(backends):
        out = reference.attention(q32, k32, v32, causal=True)
        out.backward(grad_out[:, :, :kv_heads * group].float())
    return (out.detach(), *(t.grad for t in leaves))


def subset_errors(out, grads, exact, kv_heads: int) -> dict:
    """rel_err of the output (and gradients, unless None) on the heads `exact` covers."""
    q_heads = kv_heads * Q_HEADS // KV_HEADS
    errors = {"out": rel_err(out[:, :, :q_heads], exact[0])}
    if grads is not None:
        for name, grad, ref, heads in zip(("dq", "dk", "dv"), grads, exact[1:], (q_heads, kv_heads, kv_heads)):
            errors[name] = rel_err(grad[:, :, :heads], ref)
    return errors


def has_nan(*tensors) -> bool:
    return any(bool(torch.isnan(t.float()).any()) for t in tensors)


def run_length(cudnn, handle, seqlen: int, args, record: dict, device: torch.device) -> None:
    """Build, calibrate, check and time one length; fills `record` as it goes (a failure keeps what was found).
    NaN in cuDNN's results fails the length after its timings."""
    from kernels.attention.route import flash_attention

    generator = torch.Generator(device=device).manual_seed(seqlen)
    make = lambda heads: torch.randn(1, seqlen, heads, HEAD_DIM, device=device, dtype=torch.bfloat16,  # noqa: E731
                                     generator=generator)
    q, k, v, grad_out = make(Q_HEADS), make(KV_HEADS), make(KV_HEADS), make(Q_HEADS)
    started = time.perf_counter()
    config, forward, backward = choose_graphs(cudnn, handle, seqlen, record.setdefault("refused", []))
    record["build_s"] = round(time.perf_counter() - started, 2)
    if config is None:
        raise RuntimeError("no configuration of cuDNN's FP8 forward builds on this GPU and cuDNN")
    record.update(out_dtype=config["out_dtype"], graph_kv_heads=config["kv_heads"], mask=config["mask"],
                  gqa_native=config["kv_heads"] == KV_HEADS, backward_built=backward is not None)
    if config["kv_heads"] != KV_HEADS:
        print(f"  FP8 GQA refused: K/V expanded to {config['kv_heads']} heads (the casts' timing includes it)")
    print(f"  built in {record['build_s']} s: {config['out_dtype']} output, {config['kv_heads']} KV heads, "
          f"mask {config['mask']}, backward {'built' if backward is not None else 'refused'}", flush=True)
    for name, graph in (("forward", forward), ("backward", backward)):
        if graph is not None:
            try:
                record[f"{name}_plan"] = graph.get_plan_name_at_index(0)
            except Exception as error:      # the plan's name is a note, not a result
                record[f"{name}_plan"] = short(error)
    fp8 = Fp8Attention(handle, config, forward, backward, q, k, v, grad_out)
    record["amax_and_scales"] = fp8.calibrate()
    out8 = fp8.output()
    grads8 = fp8.gradients() if backward is not None else None
    record["nan"] = has_nan(out8, fp8.buffers["stats"], *(grads8 or ()))
    record["max_abs_output"] = out8.abs().max().item()      # next to amax_o: what cuDNN's amax measures
    print(f"  amax and scales: {record['amax_and_scales']}; NaN: {record['nan']}", flush=True)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ours_out = flash_attention(*leaves, causal=True)
    ours_grads = torch.autograd.grad(ours_out, leaves, grad_out)
    if args.ref_kv_heads:
        try:
            exact = reference_subset(q, k, v, grad_out, args.ref_kv_heads)
            record["errors"] = {"cudnn_fp8": subset_errors(out8, grads8, exact, args.ref_kv_heads),
                                "ours_bf16": subset_errors(ours_out.detach(), ours_grads, exact, args.ref_kv_heads)}
            record["reference"] = (f"fp32 kernels.reference.attention on KV heads 0..{args.ref_kv_heads - 1} and "
                                   f"their query heads")
            print(f"  errors against fp32: {record['errors']}", flush=True)
            del exact
        except Exception as error:      # the timings still come
            record["reference_error"] = short(error)
            print(f"  fp32 reference failed: {short(error)}", flush=True)
    del ours_out, ours_grads, out8, grads8
    deterministic = None
    if backward is not None and args.deterministic_check:
        record["deterministic"], deterministic = deterministic_backward(cudnn, handle, seqlen, config, fp8)

    def ours_forward():
        with torch.no_grad():
            flash_attention(q, k, v, causal=True)
    forward_calls = {"ours_bf16": ours_forward, "cudnn_fp8": fp8.forward,
                     "cudnn_fp8_with_casts": fp8.forward_with_casts}
    both_calls = {"ours_bf16": lambda: torch.autograd.grad(flash_attention(*leaves, causal=True), leaves, grad_out)}
    if backward is not None:
        both_calls["cudnn_fp8"] = lambda: (fp8.forward(), fp8.backward())
        both_calls["cudnn_fp8_with_casts"] = fp8.forward_backward_with_casts
    if deterministic is not None:
        both_calls["cudnn_fp8_deterministic"] = lambda: (fp8.forward(), deterministic())
    for label, calls, with_backward in (("fwd", forward_calls, False), ("fwd+bwd", both_calls, True)):
        ms = median_ms(calls, args.rounds, args.target_ms)
        flops = causal_flops(seqlen, with_backward)
        record[f"{label}_ms"] = {name: round(value, 3) for name, value in ms.items()}
        record[f"{label}_tflops"] = {name: round(tflops(flops, value), 1) for name, value in ms.items()}
        print(f"  {label:8s}" + " | ".join(f"{name} {value:.2f} ms {tflops(flops, value):.0f} TFLOP/s"
                                           for name, value in ms.items()), flush=True)
    assert not record["nan"], "NaN in cuDNN's FP8 output or gradients"


def same_dq_twice(fp8: Fp8Attention, backward) -> bool:
    """Whether two runs of `backward` write the same dQ, bit for bit (atomics in the sum over keys would not)."""
    bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)  # noqa: E731
    backward()
    first = bits(fp8.buffers["dQ"]).clone()
    backward()
    return bool(torch.equal(first, bits(fp8.buffers["dQ"])))


def deterministic_backward(cudnn, handle, seqlen: int, config: dict, fp8: Fp8Attention):
    """cuDNN's FP8 backward with use_deterministic_algorithm: (what was found, the call to time or None). Found:
    whether it builds, and whether it and the default backward write the same dQ bit for bit over two runs."""
    found = {"default_bit_identical_dq": same_dq_twice(fp8, fp8.backward)}
    try:
        graph = backward_graph(cudnn, handle, seqlen, config["kv_heads"], config["out_type"], config["mask"],
                               deterministic=True)
    except Exception as error:
        print(f"  deterministic backward refused: {short(error)}; {found}", flush=True)
        return {**found, "built": False, "error": short(error)}, None
    workspace = fp8.workspace(graph)

    def run():
        graph.execute(fp8.backward_pack, workspace, handle=handle)
    found.update(built=True, bit_identical_dq=same_dq_twice(fp8, run))
    print(f"  deterministic backward built; {found}", flush=True)
    return found, run


def start_watchdog(seconds: float, state: dict) -> None:
    """Exit the process, whatever it is doing, `seconds` from now: the JSON lines written so far stay."""
    def expire():
        print(f"time limit of {seconds:g} s reached during {state.get('case', 'start-up')}: exiting", flush=True)
        os._exit(124)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--json", help="append one JSON line per length to this file")
    parser.add_argument("--time-limit-s", type=float, default=540.0,
                        help="the whole run's limit: past it the process exits (lines written so far stay)")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each contender, taken in turn")
    parser.add_argument("--target-ms", type=float, default=200.0, help="how long each timing lasts, about")
    parser.add_argument("--ref-kv-heads", type=int, default=1,
                        help="KV heads (with their query heads) checked against fp32 attention; 0: no check")
    parser.add_argument("--no-deterministic-check", dest="deterministic_check", action="store_false",
                        help="skip building and timing cuDNN's deterministic FP8 backward")
    args = parser.parse_args(argv)
    for length in args.seqlens:
        if length < 128 or length % 128:
            parser.error(f"--seqlens takes multiples of 128 (our kernels' tile), got {length}")
    if args.time_limit_s <= 0:
        parser.error(f"--time-limit-s must be positive, got {args.time_limit_s}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.target_ms <= 0:
        parser.error(f"--target-ms must be positive, got {args.target_ms}")
    if not 0 <= args.ref_kv_heads <= KV_HEADS:
        parser.error(f"--ref-kv-heads must be between 0 and {KV_HEADS}, got {args.ref_kv_heads}")
    return args


def load_cudnn():
    """The cuDNN frontend after torch (whose cuDNN it then finds loaded), or exit with how to get it."""
    try:
        import cudnn
    except ImportError as error:
        sys.exit(f"cudnn_fp8_attention.py needs the cuDNN frontend (import cudnn failed: {error}); put its wheel in "
                 f".whl/: {WHEELS_HINT}")
    try:
        version = cudnn.backend_version()
    except Exception as error:
        sys.exit(f"cudnn_fp8_attention.py: the cuDNN frontend {cudnn.__version__} found no cuDNN library "
                 f"({short(error)}); torch's is at {os.path.dirname(torch.__file__)}/../nvidia/cudnn/lib")
    return cudnn, version


def write_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    state = {}
    start_watchdog(args.time_limit_s, state)
    if not torch.cuda.is_available():
        sys.exit("cudnn_fp8_attention.py needs a CUDA GPU (Hopper or newer for cuDNN's FP8 attention): none is visible")
    capability = gpu_capability(torch.device("cuda"))
    if not capability.fp8:
        sys.exit(f"cudnn_fp8_attention.py needs a Hopper or newer GPU for cuDNN's FP8 attention, got "
                 f"{capability.name} (compute capability {capability.compute_capability})")
    cudnn, backend = load_cudnn()
    torch.backends.cuda.matmul.allow_tf32 = False       # the fp32 reference stays fp32
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    from kernels.attention import flash_attention as fa
    fa.ensure_allocator(torch.device("cuda"))
    common = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "torch_cudnn": torch.backends.cudnn.version(), "cudnn_backend": backend,
              "cudnn_frontend": cudnn.__version__, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "causal": True, "batch": 1, "flops": "causal: fwd 2*S^2*heads*D, fwd+bwd 3.5x"}
    print(common, flush=True)
    summary = []
    for seqlen in args.seqlens:
        state["case"] = f"S={seqlen}"
        print(f"S={seqlen}", flush=True)
        record = {**common, "seqlen": seqlen, "status": "ok"}
        started = time.perf_counter()
        try:
            run_length(cudnn, handle, seqlen, args, record, torch.device("cuda"))
        except Exception as error:
            record.update(status="failed", error=short(error))
            print(f"  S={seqlen} failed: {short(error)}", flush=True)
            traceback.print_exc(limit=4)
        record["length_s"] = round(time.perf_counter() - started, 1)     # what the next run's time limit needs
        print(f"  S={seqlen} took {record['length_s']} s", flush=True)
        write_json(args.json, record)
        summary.append(record)
        torch.cuda.empty_cache()
    print("\n| S | contender | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|")
    for record in summary:
        names = list(dict.fromkeys([*record.get("fwd_ms", {}), *record.get("fwd+bwd_ms", {})]))
        for name in names or ["(failed)"]:
            cells = [f"{record.get(f'{k}_ms', {}).get(name, '-')} | {record.get(f'{k}_tflops', {}).get(name, '-')}"
                     for k in ("fwd", "fwd+bwd")]
            print(f"| {record['seqlen']} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
