"""FP8 for the frozen base of a LoRA run (train.fp8=true, GPUs with FP8 tensor cores): each decoder
projection's weight is held in float8 e4m3 with one fp32 scale per output row, quantized once when the model
is built (the bf16 weight is freed), and the projection's forward and input-gradient products run in FP8
(kernels.scaled_matmul). Adapters, norms, attention, loss and optimizer stay as they are.

  forward   y = x W^T (+ b) x quantized per row (token), W per output row; a bias (Qwen2's q/k/v), frozen
                            like W, added after the product in its output dtype:
                            y[m, n] = sx[m] sw[n] sum_k qx[m, k] qw[n, k] (+ b[n])
  backward  dx = g W        the sum runs over W's rows, so their scales cannot stay outside it: they scale g's
                            columns before g is quantized (folded into the quantization),
                            dx[m, k] = sg[m] sum_n q(g sw)[m, n] qw[n, k]

FP8 tensor cores read both operands along the summed dimension, so the backward's product reads W transposed:
a one-byte copy made for the product and freed after it, rather than a second copy of every weight kept.
The forward's product accumulates in Hopper's fast FP8 mode, the backward's with cuBLAS's promotion to fp32
(torchao.float8's defaults). The forward saves nothing for the backward (the base is frozen: no weight
gradient needs the input). An input that several projections read (q, k and v read the normed hidden state;
gate and up the MLP's input) is quantized once (SharedQuantizedInput). Quality and speed against bf16, and
what fast accumulation gains: docs/PERFORMANCE.md, "FP8 for the frozen base".
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

import kernels
from kernels.rows import as_rows
from model.hf_checkpoint import unwrap_model

# The decoder projections that run in FP8, with the groups that read one input.
SHARED_INPUTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                 ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
# cuBLAS's FP8 products take widths that are multiples of 16.
WIDTH_MULTIPLE = 16


@dataclass
class _Quantized:
    source: weakref.ref
    version: int
    values: torch.Tensor
    scale: torch.Tensor
    readers_left: int


class SharedQuantizedInput:
    """The e4m3 copy of one input that `readers` projections read in turn: made by the first, dropped after the
    last, so it lives only while they run. A reader handed another tensor, or this one changed in place since,
    quantizes anew (and a group left unfinished holds its copy until the next quantization replaces it)."""

    def __init__(self, readers: int):
        self.readers = readers
        self._kept: _Quantized | None = None

    def quantized(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_inference():         # no version counter to tell a changed tensor by: quantize each time
            return kernels.quantize_rows(rows)
        kept = self._kept
        if kept is not None and kept.source() is x and kept.version == x._version:
            kept.readers_left -= 1
            if kept.readers_left == 0:
                self._kept = None
            return kept.values, kept.scale
        values, scale = kernels.quantize_rows(rows)
        self._kept = (_Quantized(weakref.ref(x), x._version, values, scale, self.readers - 1)
                      if self.readers > 1 else None)
        return values, scale


class Fp8Product(torch.autograd.Function):
    """y = x W^T of a frozen Fp8Linear. Saves nothing; the backward quantizes the incoming gradient with W's
    row scales folded in and multiplies it by W transposed (see the module docstring). `unread`: nothing will
    read y (offload.policy.UnreadOutputs), so the forward computes nothing and returns an uninitialized y."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: "Fp8Linear", unread: bool = False) -> torch.Tensor:
        kind = x.device.type
        out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        ctx.linear, ctx.input_dtype = linear, x.dtype
        if unread:
            return torch.empty(*x.shape[:-1], linear.out_features, dtype=out_dtype, device=x.device)
        values, scale = linear.shared_input.quantized(x, as_rows("FP8 projection", "input", x))
        y = kernels.scaled_matmul(values, scale, linear.weight_fp8, linear.weight_scale, out_dtype,
                                  fast_accumulation=True)
        if linear.bias is not None:      # frozen, so no gradient: added to the product in its output dtype
            y.add_(linear.bias.to(out_dtype))
        return y.view(*x.shape[:-1], linear.out_features)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        linear = ctx.linear
        values, scale = kernels.quantize_rows(as_rows("FP8 projection", "gradient", grad), linear.weight_scale)
        weight_t = kernels.transpose(linear.weight_fp8)
        ones = torch.ones(linear.in_features, dtype=torch.float32, device=grad.device)
        grad_x = kernels.scaled_matmul(values, scale, weight_t, ones, ctx.input_dtype)
        return grad_x.view(*grad.shape[:-1], linear.in_features), None, None


class Fp8Linear(nn.Module):
    """A frozen nn.Linear whose weight is held as e4m3 [out, in] (`weight_fp8`) with fp32 scales per output row
    (`weight_scale`), and its bias (Qwen2's q/k/v), if any, kept as it was: a frozen parameter in its own dtype.
    Its state dict holds `weight`, dequantized, and `bias` under the Linear's names, so whatever reads a model's
    weights (a random base kept for export) finds them; loading one quantizes the weight."""

    def __init__(self, linear: nn.Linear, shared_input: SharedQuantizedInput | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.shared_input = shared_input or SharedQuantizedInput(readers=1)
        self.register_buffer("weight_fp8", None, persistent=False)
        self.register_buffer("weight_scale", None, persistent=False)
        self.set_weight(linear.weight.detach())

    def set_weight(self, weight: torch.Tensor) -> None:
        self.weight_fp8, self.weight_scale = kernels.quantize_rows(weight)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (self.weight_fp8.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fp8Product.apply(x, self)

    def forward_unread(self, x: torch.Tensor) -> torch.Tensor:
        """The forward where nothing reads the output: only the input's gradient is computed (in the backward)."""
        return Fp8Product.apply(x, self, True)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if prefix + "weight" in state_dict:
            self.set_weight(state_dict[prefix + "weight"].to(self.weight_scale.device))
        else:
            missing_keys.append(prefix + "weight")
        if self.bias is None:
            return
        if prefix + "bias" in state_dict:
            with torch.no_grad():
                self.bias.copy_(state_dict[prefix + "bias"])
        else:
            missing_keys.append(prefix + "bias")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"e4m3 with row scales")


def check_fp8_widths(hidden: int, attention_width: int, kv_width: int, intermediate: int) -> str | None:
    """Why the FP8 products cannot take this architecture (a width cuBLAS refuses), or None."""
    widths = {"hidden_size": hidden, "attention heads x head_dim": attention_width,
              "key/value heads x head_dim": kv_width, "intermediate_size": intermediate}
    odd = [f"{name}={width}" for name, width in widths.items() if width % WIDTH_MULTIPLE]
    return f"{', '.join(odd)} not a multiple of {WIDTH_MULTIPLE}" if odd else None


def quantize_frozen_base(model: nn.Module) -> int:
    """Replace every decoder projection of `model` (the nn.Linear, under peft's LoRA wrapper if any) by an
    Fp8Linear, freeing the bf16 weights; returns how many. The base must be frozen: nothing trains it after."""
    count = 0
    for layer in unwrap_model(model).model.layers:
        for block_name, names in SHARED_INPUTS:
            block = getattr(layer, block_name)
            shared = SharedQuantizedInput(readers=len(names))
            for name in names:
                module = getattr(block, name)
                holder, attribute = (module, "base_layer") if hasattr(module, "base_layer") else (block, name)
                linear = getattr(holder, attribute)
                if any(param.requires_grad for param in linear.parameters()):
                    raise ValueError(f"quantize_frozen_base: {block_name}.{name} is trained; FP8 holds only a "
                                     f"frozen base")
                setattr(holder, attribute, Fp8Linear(linear, shared))
                count += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()        # the freed bf16 weights go back to the GPU, not to the allocator's cache
    return count


def fp8_weight_count(model: nn.Module) -> int:
    """Weights held in FP8 (they are buffers, not parameters)."""
    return sum(module.weight_fp8.numel() for module in model.modules() if isinstance(module, Fp8Linear))
