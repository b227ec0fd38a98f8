"""Our Llama under a wrapper, apart from model/llama.py so that the checkpoint code (model/hf_checkpoint.py),
which Llama.from_pretrained calls, can unwrap a model without importing the module that imports it."""
from __future__ import annotations

from torch import nn


def unwrap_llama(model: nn.Module) -> nn.Module:
    """Our Llama under any wrapper (peft's PeftModel -> LoraModel -> Llama)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
