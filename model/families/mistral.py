"""Mistral 7B v0.2/v0.3 (transformers' MistralForCausalLM): Llama's decoder under its own class and defaults.
MistralConfig defaults to a 4096-token sliding window (v0.1 uses it), so a config.json that leaves
`sliding_window` out is windowed and refused; v0.2/v0.3 write `sliding_window: null`."""
from model.family import ModelFamily

MISTRAL = ModelFamily(
    name="mistral",
    model_types=("mistral",),
    hf_architecture="MistralForCausalLM",
    # MistralConfig's defaults where they differ from Llama's, for a config.json that leaves them out.
    defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
              "sliding_window": 4096},
    hf_constants={"hidden_act": "silu", "sliding_window": None, "attention_dropout": 0.0},
    required={"hidden_act": "silu"},
)
