"""Qwen2 and Qwen2.5 (transformers' Qwen2ForCausalLM, 0.5B to 72B): Llama's decoder with a bias on the q, k
and v projections (not o). Qwen2Config has no attention_bias key: the bias is always there. Their config.json
keeps `sliding_window` with `use_sliding_window: false` (no window); a window switched on is refused, as for
every family."""
from model.family import LayerOps, ModelFamily

QWEN2 = ModelFamily(
    name="qwen2",
    model_types=("qwen2",),
    hf_architecture="Qwen2ForCausalLM",
    layer=LayerOps(qkv_bias=True),
    # Qwen2Config's defaults where they differ from Llama's, for a config.json that leaves them out.
    defaults={"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    hf_constants={"hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
                  "attention_dropout": 0.0},
    required={"hidden_act": "silu"},
)
