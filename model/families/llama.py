"""Llama 3 / 3.1 (transformers' LlamaForCausalLM): the shared decoder with no optional op."""
from model.family import ModelFamily

LLAMA = ModelFamily(
    name="llama",
    model_types=("llama",),
    hf_architecture="LlamaForCausalLM",
    hf_constants={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    required={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
)
