"""The decoder every model family shares (Llama 3, Qwen3, ...), with the parameter names of transformers'
causal-LM classes. A family (model/family.py) switches the layer's optional ops on (QK-norm, q/k/v bias).

The model knows nothing about memory policy: `Decoder.run_layer` is the single place a decoder layer is
called, and `offload/` replaces it on an instance to checkpoint, offload or tile. Ops go through
`kernels`, which picks Triton on CUDA and the PyTorch reference elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kernels
from model.config import DecoderConfig
from model.hf_checkpoint import load_pretrained
from model.rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    # Which attention implementations run: installed by trainer.build as the memory plan chose them; None:
    # kernels.attention.route.default_route.
    route: kernels.attention.AttentionRoute | None = None

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.ops.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.q_heads * self.head_dim, cfg.hidden_size, bias=False)
        # QK-norm: one RMSNorm weight over head_dim, shared by every head; absent (no parameters) elsewhere
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.ops.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.ops.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.q_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seqlen, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seqlen, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.rope(q, k, *rope)   # new rotated tensors (kernels/rope_triton.py says why not in place)
        out = kernels.attention.attention(q, k, v, self.route, causal=True, cu_seqlens=cu_seqlens)
        return self.o_proj(out.reshape(batch, seqlen, self.q_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, cu_seqlens)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def positions_from_documents(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Positions restarting at 0 at every document start of a packed [batch, seqlen] block."""
    total = batch * seqlen
    flat = torch.arange(total, device=cu_seqlens.device)
    doc = kernels.reference.document_ids(cu_seqlens, total)
    return (flat - cu_seqlens.long()[doc]).view(batch, seqlen)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The sequence length a dynamic or longrope rope is computed for; None: each input's own length. The
        # trainer fixes it at seq_len (CausalLM.train_rope_at).
        self.rope_length: int | None = None

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg, position_ids, dtype, self.rope_length)

    def run_layer(self, layer: DecoderLayer, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """Call one decoder layer. Memory policies (offload/) replace this on the instance."""
        return layer(hidden, rope, cu_seqlens)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        batch, seqlen = input_ids.shape
        if position_ids is None:
            position_ids = (positions_from_documents(cu_seqlens, batch, seqlen) if cu_seqlens is not None
                            else torch.arange(seqlen, device=input_ids.device).expand(batch, seqlen))
        hidden = self.embed_tokens(input_ids)
        rope = self.rope(position_ids, hidden.dtype)
        for layer in self.layers:
            hidden = self.run_layer(layer, hidden, rope, cu_seqlens)
        return self.norm(hidden)


class CausalLM(nn.Module):
    """Causal LM: `forward` returns the final hidden states; the loss comes from them and
    `lm_head.weight` through `kernels.linear_cross_entropy`, so full logits are never built."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def train_rope_at(self, seq_len: int) -> None:
        """Compute a dynamic or longrope rope for `seq_len`-token sequences whatever a forward's input (a
        packed row's documents, a sequence-parallel slice): one rope for the whole run."""
        self.model.rope_length = seq_len

    def tie_weights(self) -> None:
        """Share the embedding with the head when configured; re-run after anything that replaces params."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of the next-token predictions; labels are already shifted (-100 = no loss)."""
        return kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                            labels.reshape(-1), reduction=reduction)

    @classmethod
    def from_config(cls, cfg: DecoderConfig | dict[str, Any], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> "CausalLM":
        """A randomly initialised model (normal(0, initializer_range) weights, unit norms)."""
        if not isinstance(cfg, DecoderConfig):
            cfg = DecoderConfig.from_dict(dict(cfg))
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights()
        return model.to(dtype)

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                if getattr(module, "bias", None) is not None:     # as transformers initialises one
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                        overrides: dict[str, Any] | None = None) -> "CausalLM":
        """The checkpoint at `path`, its config.json's architecture updated by `overrides` (the rope keys:
        model.hf_checkpoint.ROPE_OVERRIDE_KEYS)."""
        return load_pretrained(cls, path, dtype=dtype, device=device, overrides=overrides)
