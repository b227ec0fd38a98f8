"""LoRA adapters at the cost of their matrix products: each adapter's up-projection, its scaling and the add
onto the base projection's output run as one `addmm` (cuBLAS applies the scaling and the add in its
epilogue), instead of peft's product, then a multiply and an add over the whole [tokens, out_features]
output, in the forward, in the backward and again in every checkpointed recomputation (what that cost a
LoRA step: docs/PERFORMANCE.md, "Design choices measured").

The parameters, their names and peft's adapter format are untouched: only each adapter layer's `forward`
is replaced on the instance, and it hands back to peft's own forward whenever peft would do more than one
plain adapter (adapters disabled or merged, several active, DoRA or other variants, a bias on the
up-projection, extra call arguments)."""
from __future__ import annotations

import torch
from torch import nn


def fuse_adapter_products(model: nn.Module) -> int:
    """Install the fused forward on every peft LoRA Linear of `model`; returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.forward = FusedAdapterForward(layer)
    return len(layers)


class FusedAdapterForward:
    """`base(x) + scaling * B(A(dropout(x)))` with the last product, the scaling and the add in one addmm."""

    def __init__(self, layer: nn.Module):
        self.layer, self.peft_forward = layer, layer.forward

    def _single_plain_adapter(self) -> str | None:
        layer = self.layer
        if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
            return None
        name = layer.active_adapters[0]
        if name not in layer.lora_A or name in layer.lora_variant or layer.lora_B[name].bias is not None:
            return None
        return name

    def _one_dtype(self, x: torch.Tensor, name: str) -> bool:
        """addmm takes one dtype: autocast gives it; otherwise base, adapters and input must already agree
        (a bf16 base with fp32 adapters outside autocast is left to peft, which promotes)."""
        layer = self.layer
        dtypes = {x.dtype, layer.lora_A[name].weight.dtype, layer.lora_B[name].weight.dtype}
        if isinstance(layer.base_layer, nn.Linear):     # an FP8 base (model.fp8) gives x's or autocast's dtype
            dtypes.add(layer.base_layer.weight.dtype)
        return torch.is_autocast_enabled(x.device.type) or len(dtypes) == 1

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = None if args or kwargs else self._single_plain_adapter()
        if name is None or not self._one_dtype(x, name):
            return self.peft_forward(x, *args, **kwargs)
        layer = self.layer
        result = layer.base_layer(x)
        lora_a = layer.lora_A[name]
        down = lora_a(layer.lora_dropout[name](layer._cast_input_dtype(x, lora_a.weight.dtype)))
        up_weight = layer.lora_B[name].weight                       # [out_features, r]
        fused = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), up_weight.t(),
                            alpha=layer.scaling[name])
        return fused.view(result.shape).to(result.dtype)
