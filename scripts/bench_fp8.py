"""The FP8 products of train.fp8 (model/fp8.py) on Llama-3-8B's projection shapes, beside bf16 and torchao's
float8 training, and one decoder layer's error against bf16.

    python scripts/bench_fp8.py [--tokens 32768] [--error-tokens 8192] [--torchao] [--json OUT]

Per projection (q, k, v, o, gate, up, down) and for a whole layer's seven, the time of what a frozen base
projection costs in a LoRA step, its forward plus its input gradient:
  bf16          F.linear and the input gradient's product (cuBLAS);
  fp8           ours: the Triton row quantizer, then cuBLAS's row-scaled FP8 product; the backward's quantizer
                (with the weight's row scales folded in), the weight's transposition and product;
  fp8 eager     the same products with the quantization in PyTorch's eager ops;
  fp8 products  cuBLAS's row-scaled FP8 products alone (the ceiling of the two above);
  torchao ...   torchao.float8's Float8Linear (tensorwise and rowwise recipes, eager and under torch.compile)
                on the frozen bf16 weight, forward and backward with the input's gradient.
Then one decoder layer of the 8B shape (random weights, std 0.02; then with q and k scaled by 4, a sharper
attention) in fp32, bf16 and FP8: the relative error ||out - ref|| / ||ref|| of the output and of
the input's gradient, against fp32 and FP8 against bf16. Prints a table and a last line of JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import reference
from model.config import DecoderConfig
from model.fp8 import Fp8Linear, quantize_frozen_base
from model.decoder import DecoderLayer, CausalLM

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
               "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `repeats` runs, timed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def projection_times(tokens: int, in_features: int, out_features: int, use_torchao: bool) -> dict[str, float]:
    device = torch.device("cuda")
    weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16) * 1e-3
    linear = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
    linear.weight.data.copy_(weight)
    linear.weight.requires_grad_(False)
    fp8 = Fp8Linear(linear)
    qw, sw = fp8.weight_fp8, fp8.weight_scale
    qx, sx = kernels.quantize_rows(x)
    qg, sg = kernels.quantize_rows(grad, sw)
    qw_t = qw.t().contiguous()
    ones = torch.ones(in_features, device=device)

    def bf16():
        F.linear(x, weight)
        grad @ weight

    def ours():
        xi = x.detach().requires_grad_(True)
        fp8(xi).backward(grad)

    def eager():
        a, s = reference.quantize_rows(x)
        kernels.scaled_matmul(a, s, qw, sw, torch.bfloat16)
        b, t = reference.quantize_rows(grad, sw)
        kernels.scaled_matmul(b, t, kernels.transpose(qw), ones, torch.bfloat16)

    def products(fast_accumulation: bool = False):
        kernels.scaled_matmul(qx, sx, qw, sw, torch.bfloat16, fast_accumulation)
        kernels.scaled_matmul(qg, sg, qw_t, ones, torch.bfloat16, fast_accumulation)

    times = {"bf16": timed(bf16), "fp8": timed(ours), "fp8 eager": timed(eager), "fp8 products": timed(products),
             "fp8 products fast accumulation": timed(lambda: products(True)),
             "fp8 quantize x": timed(lambda: kernels.quantize_rows(x)),
             "fp8 quantize g": timed(lambda: kernels.quantize_rows(grad, sw)),
             "fp8 transpose w": timed(lambda: kernels.transpose(qw)),
             "torch transpose w": timed(lambda: qw.t().contiguous())}
    if use_torchao:
        times.update(torchao_times(linear, x, grad))
    return times


def torchao_times(linear: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    times = {}
    for recipe in ("tensorwise", "rowwise"):
        for compiled in (False, True):
            holder = torch.nn.Sequential(copy.deepcopy(linear))
            convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(recipe))
            module = torch.compile(holder) if compiled else holder

            def run():
                xi = x.detach().requires_grad_(True)
                module(xi).backward(grad)
            name = f"torchao {recipe}{' compiled' if compiled else ''}"
            try:
                times[name] = timed(run)
            except Exception as error:          # report, do not stop the other measurements
                print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return times


def quantizer_sweep(tokens: int) -> dict[str, float]:
    """Milliseconds of the row quantizer per launch configuration, on a 4096- and a 14336-wide input."""
    from kernels.quantize_rows_triton import quantize_rows
    result = {}
    for width in (4096, 14336):
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        column_scale = torch.rand(width, device="cuda") + 0.5
        for block_m, block_k, warps in ((4, 1024, 4), (1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (8, 512, 4),
                                        (4, 2048, 8), (8, 1024, 8), (16, 512, 8), (2, 2048, 4)):
            for scaled in (False, True):
                name = f"{width} m{block_m} k{block_k} w{warps}{' colscale' if scaled else ''}"
                result[name] = timed(lambda: quantize_rows(x, column_scale if scaled else None, block_m, block_k,
                                                           warps))
    return result


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def layer_errors(tokens: int, sharpen: float) -> dict[str, float]:
    """One decoder layer of the 8B shape in fp32, bf16 and FP8 (same weights, q and k scaled by `sharpen`):
    output and input-gradient errors."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    cfg = DecoderConfig.from_dict(LLAMA3_8B)
    layer = DecoderLayer(cfg).to(device)
    for name, parameter in layer.named_parameters():
        if parameter.dim() == 2:
            torch.nn.init.normal_(parameter, std=0.02)
        parameter.requires_grad_(False)
    with torch.no_grad():       # sharper attention than random weights give
        layer.self_attn.q_proj.weight.mul_(sharpen)
        layer.self_attn.k_proj.weight.mul_(sharpen)
    rope_model = CausalLM.from_config(dict(LLAMA3_8B, vocab_size=16), device=device).model
    positions = torch.arange(tokens, device=device)[None]
    hidden = torch.randn(1, tokens, cfg.hidden_size, device=device)
    grad = torch.randn(1, tokens, cfg.hidden_size, device=device)

    def run(module, dtype):
        x = hidden.detach().clone().to(dtype).requires_grad_(True)
        out = module(x, rope_model.rope(positions, dtype), None)
        out.backward(grad.to(dtype))
        return out.detach(), x.grad.detach()

    out32, grad32 = run(layer, torch.float32)
    bf16_layer = layer.to(torch.bfloat16)
    out16, grad16 = run(bf16_layer, torch.bfloat16)
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([bf16_layer])
    quantize_frozen_base(holder)
    out8, grad8 = run(bf16_layer, torch.bfloat16)
    return {"bf16 output vs fp32": relative_error(out16, out32), "fp8 output vs fp32": relative_error(out8, out32),
            "fp8 output vs bf16": relative_error(out8, out16),
            "bf16 input grad vs fp32": relative_error(grad16, grad32),
            "fp8 input grad vs fp32": relative_error(grad8, grad32),
            "fp8 input grad vs bf16": relative_error(grad8, grad16)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--error-tokens", type=int, default=8192)
    parser.add_argument("--torchao", action="store_true", help="measure torchao.float8 too")
    parser.add_argument("--sweep-quantizer", action="store_true", help="time the quantizer's launch settings")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {"gpu": torch.cuda.get_device_name(), "tokens": args.tokens, "projections": {}}
    for name, (in_features, out_features) in PROJECTIONS.items():
        result["projections"][name] = projection_times(args.tokens, in_features, out_features, args.torchao)
    columns = list(next(iter(result["projections"].values())))
    layer = {column: sum(times.get(column, float("nan")) for times in result["projections"].values())
             for column in columns}
    result["layer"] = layer
    print(f"{'ms (forward + input gradient)':<24}" + "".join(f"{c:>22}" for c in columns))
    for name, times in [*result["projections"].items(), ("layer (7 products)", layer)]:
        print(f"{name:<24}" + "".join(f"{times.get(c, float('nan')):>22.3f}" for c in columns))
    print("speed-up over bf16, layer: " + ", ".join(f"{c} {layer['bf16'] / layer[c]:.2f}x" for c in columns
                                                    if not c.startswith("fp8 quantize") and "transpose" not in c))
    if args.sweep_quantizer:
        result["quantizer"] = quantizer_sweep(args.tokens)
        for name, value in result["quantizer"].items():
            print(f"quantizer {name:<36}{value:.3f} ms")
    for sharpen in (1.0, 4.0):
        errors = result[f"errors, q and k x{sharpen:g}"] = layer_errors(args.error_tokens, sharpen)
        for name, value in errors.items():
            print(f"q, k x{sharpen:g}: {name:<28}{value:.5f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
