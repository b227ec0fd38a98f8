"""The decoder's architecture hyper-parameters, with the field names of transformers' config classes, and the
model family (model/family.py) that says which of the shared decoder's ops it uses and how its config.json
is spelled."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model.families import DEFAULT_FAMILY, family_named, family_of_config
from model.family import LayerOps, ModelFamily, sliding_window_refusal

# The rope types transformers implements for Llama (model.rope computes them with transformers' code), with
# the rope_scaling keys each reads.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
ROPE_TYPES = tuple(ROPE_KEYS)
# The rope types that scale from an original context (rope_scaling's original_max_position_embeddings).
ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")


@dataclass
class DecoderConfig:
    # The model family (model.family; model/families/); the other defaults are Llama-3 8B's.
    family: str = DEFAULT_FAMILY
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None (the default rope), or the scaling as in config.json's `rope_scaling` (transformers 4) or
    # `rope_parameters` (5) without its rope_theta: {"rope_type": "yarn", "factor": 8.0, ...}.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        self.rope_scaling = canonical_rope_scaling(self.rope_scaling)
        family_named(self.family)

    @property
    def spec(self) -> ModelFamily:
        return family_named(self.family)

    @property
    def ops(self) -> LayerOps:
        """The shared layer's optional ops this family uses (model.family.LayerOps)."""
        return self.spec.layer

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DecoderConfig":
        """Build from an HF config.json dict (its family from `model_type`; v4 `rope_scaling` or v5
        `rope_parameters`) or our own fields (`family`, default llama). ValueError for what is not built here:
        another family, windowed attention, an option the family's layer lacks."""
        values = dict(values)
        refusal = sliding_window_refusal(values)
        if refusal:
            raise ValueError(refusal)
        is_hf = "model_type" in values or "architectures" in values
        family = family_of_config(values) if is_hf else family_named(values.get("family", cls.family))
        # A window the family's config class switches on where config.json leaves it out (Mistral's default).
        refusal = (is_hf and sliding_window_refusal({**family.defaults, **values})) or family.refusal(values)
        if refusal:
            raise ValueError(refusal)
        rope_parameters = values.pop("rope_parameters", None)
        if rope_parameters:
            values.setdefault("rope_theta", rope_parameters.get("rope_theta"))
            values["rope_scaling"] = rope_parameters
        values["rope_scaling"] = with_original_context(values.get("rope_scaling"),
                                                       values.pop("original_max_position_embeddings", None))
        names = {f.name for f in dataclasses.fields(cls)}
        built = {**family.defaults, **{key: value for key, value in values.items() if value is not None},
                 "family": family.name}
        return cls(**{key: value for key, value in built.items() if key in names})

    def to_dict(self) -> dict[str, Any]:
        """The HF-style dict that peft and loggers read as `model.config`."""
        return self.to_hf_dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_hf_dict().get(key, default)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents that transformers loads as this family's class (LlamaForCausalLM, ...)."""
        values = dataclasses.asdict(self)
        family = family_named(values.pop("family"))
        values.update(architectures=[family.hf_architecture], model_type=family.model_types[0], **family.hf_constants)
        return values


def with_original_context(scaling: dict[str, Any] | None, original: int | None) -> dict[str, Any] | None:
    """`scaling` with a config.json's top-level original_max_position_embeddings (Phi-3 style files) moved in,
    where its type reads one: transformers gives that top-level value priority over the scaling's own."""
    if original is None or not scaling or scaling.get("rope_type", scaling.get("type")) not in ORIGINAL_CONTEXT_TYPES:
        return scaling
    return {**scaling, "original_max_position_embeddings": original}


def canonical_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """`scaling` as one layout: `rope_type` (older files say `type`), no rope_theta (a field of its own),
    None for the default rope, and without the keys only other rope types read (transformers ignores them;
    they come from a command-line scaling merged into a model group's, e.g. yarn over Llama-3.1's llama3).
    ValueError for a type transformers does not implement for Llama."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    others = {key for keys in ROPE_KEYS.values() for key in keys} - set(ROPE_KEYS[rope_type])
    kept = {key: value for key, value in scaling.items() if key not in others | {"rope_theta", "type", "rope_type"}}
    return None if rope_type == "default" else {"rope_type": rope_type, **kept}
