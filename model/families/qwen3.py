"""Qwen3 dense models (transformers' Qwen3ForCausalLM, 0.6B to 32B): Llama's decoder with an RMSNorm on each
head of q and k before RoPE, and a head_dim of its own (not hidden_size / heads: 0.6B has 16 heads of 128
over a 1024-wide residual). Windowed attention (use_sliding_window) is refused, as for every family."""
from model.family import LayerOps, ModelFamily

QWEN3 = ModelFamily(
    name="qwen3",
    model_types=("qwen3",),
    hf_architecture="Qwen3ForCausalLM",
    layer=LayerOps(qk_norm=True),
    # Qwen3Config's defaults where they differ from Llama's, for a config.json that leaves them out.
    defaults={"head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    hf_constants={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": None, "attention_dropout": 0.0},
    required={"hidden_act": "silu", "attention_bias": False},
)
