"""Every rope type transformers implements for Llama, against transformers' LlamaForCausalLM: the same
checkpoint gives the same logits (fp32) at positions four times beyond its original context, in both
config.json layouts (transformers 5's `rope_parameters`, the older `rope_scaling` with `type`)."""
import json
import re

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from model import CausalLM, DecoderConfig
from model.hf_checkpoint import HFCheckpointError, read_config, with_overrides
from model.rope import rope_frequencies

ORIGINAL = 64           # the checkpoint's trained context
LENGTH = 4 * ORIGINAL   # the positions compared: 0 .. LENGTH - 1
HEAD_DIM = 16
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # transformers rescales dynamic NTK per forward from the longest position (max_seq_len_cached starts at
    # max_position_embeddings = ORIGINAL). One unpacked sequence of LENGTH tokens is rescaled for LENGTH,
    # which is the length our model computes it for (its input's, or the trainer's seq_len).
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-options": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                     "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    # LongRoPE takes its long factors beyond the original context; its attention factor comes from
    # max_position_embeddings / original_max_position_embeddings.
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}
TOKENS = torch.randint(0, 97, (1, LENGTH), generator=torch.Generator().manual_seed(0))


def hf_model(rope_scaling) -> LlamaForCausalLM:
    """A tiny transformers Llama whose attention is sharp (large q and k weights), so that a wrong rope
    changes its logits; max_position_embeddings is the extended context for the scaled ropes."""
    extended = rope_scaling is not None and rope_scaling["rope_type"] in ("yarn", "longrope", "llama3")
    config = HFLlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                           max_position_embeddings=LENGTH if extended else ORIGINAL,
                           rope_scaling=dict(rope_scaling) if rope_scaling else None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    return model


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(model: CausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS) @ model.lm_head.weight.t()


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def older_layout(directory) -> None:
    """config.json rewritten as transformers 4 wrote it: rope_theta beside `rope_scaling`, keyed `type`."""
    config = json.loads((directory / "config.json").read_text())
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    rope_type = parameters.pop("rope_type")
    config["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **parameters}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", list(ROPES))
def test_each_rope_type_matches_transformers_beyond_the_original_context(tmp_path, name):
    hf = hf_model(ROPES[name])
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    expected = hf_logits(hf)
    ours = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.rope_type == (ROPES[name] or {"rope_type": "default"})["rope_type"]
    assert max_difference(our_logits(ours), expected) <= 1e-5

    older_layout(tmp_path)
    again = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.config == ours.config
    assert max_difference(our_logits(again), expected) <= 1e-5

    # The comparison can fail: the same weights under the unscaled rope (or, for the default, another
    # theta) give other logits.
    wrong = {"rope_theta": 20000.0} if ROPES[name] is None else {"rope_scaling": {"rope_type": "default"}}
    other = CausalLM.from_pretrained(tmp_path, dtype=torch.float32, overrides=wrong)
    assert max_difference(our_logits(other), expected) > 1e-2


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_dynamic_and_longrope_are_computed_at_the_trained_length(name):
    """The trainer fixes the length (CausalLM.train_rope_at): a short input is rotated as at that length (for
    longrope: with its long factors, and their attention factor)."""
    extended = LENGTH if name == "longrope" else ORIGINAL
    cfg = DecoderConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=extended, rope_theta=10000.0,
                      rope_scaling=ROPES[name])
    model = CausalLM.from_config(cfg)
    short = model.model.rope(torch.arange(8)[None], torch.float32)[0]
    model.train_rope_at(LENGTH)
    fixed = model.model.rope(torch.arange(8)[None], torch.float32)[0]
    inv_freq, attention_factor = rope_frequencies(cfg, LENGTH)
    assert not torch.equal(inv_freq, rope_frequencies(cfg, 8)[0])
    angles = torch.arange(8).float()[:, None] * inv_freq
    torch.testing.assert_close(fixed[0, :, 0, : HEAD_DIM // 2], angles.cos() * attention_factor)
    assert not torch.equal(short, fixed)


def test_an_unknown_rope_type_or_a_missing_parameter_is_named(tmp_path):
    config = {"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="rope_type 'ntk-by-parts' is not one of default, linear"):
        read_config(tmp_path)
    config["rope_scaling"] = {"rope_type": "linear"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="does not define a linear rope: .*factor"):
        read_config(tmp_path)


@pytest.mark.parametrize("name", ["yarn", "longrope", "llama3"])
def test_a_top_level_original_context_is_read_as_transformers_reads_it(tmp_path, name):
    """Phi-3 style files keep original_max_position_embeddings beside the scaling; transformers takes it."""
    hf_model(ROPES[name]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]["original_max_position_embeddings"]
    config["original_max_position_embeddings"] = ORIGINAL
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = hf_logits(LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval())
    ours = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert max_difference(our_logits(ours), expected) <= 1e-5


# --- issue 47: values outside the domain transformers' rope validation states are refused, not trained ---

@pytest.mark.parametrize("scaling,problem", [
    ({"rope_type": "linear", "factor": 0.0}, "factor=0.0 must be a number >= 1"),
    ({"rope_type": "dynamic", "factor": -2.0}, "factor=-2.0 must be a number >= 1"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": ORIGINAL},
     "factor=0.5 must be a number >= 1"),
    ({"rope_type": "llama3", "factor": 0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": ORIGINAL}, "factor=0 must be a number >= 1"),
    ({**ROPES["longrope"], "factor": 0.5}, "factor=0.5 must be a number >= 1"),
    ({**ROPES["yarn"], "beta_fast": 1.0, "beta_slow": 32.0}, "beta_fast=1.0 must be greater than beta_slow=32.0"),
    ({**ROPES["yarn"], "beta_fast": 1.0}, "beta_fast=1.0 must be greater than beta_slow=1 (its default)"),
    ({**ROPES["yarn"], "attention_factor": 0.0}, "attention_factor=0.0 must be a positive number"),
    ({**ROPES["yarn"], "attention_factor": -1.0}, "attention_factor=-1.0 must be a positive number"),
    ({**ROPES["yarn"], "mscale": -10.0, "mscale_all_dim": 1.0},
     "mscale=-10.0 and mscale_all_dim=1.0 give an attention factor of -0.339, which must be positive"),
    ({**ROPES["longrope"], "attention_factor": -0.5}, "attention_factor=-0.5 must be a positive number"),
    ({**ROPES["longrope"], "short_factor": [1.0] * 3},
     "short_factor must be a list of 8 positive numbers (head_dim / 2)"),
    ({**ROPES["longrope"], "long_factor": [1.0] * 7 + [0.0]}, "long_factor must be a list of 8 positive numbers"),
    ({**ROPES["llama3"], "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "low_freq_factor=4.0 must be below high_freq_factor=1.0"),
])
def test_rope_values_outside_their_domain_are_refused_naming_the_value(scaling, problem):
    cfg = DecoderConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=LENGTH, rope_theta=10000.0)
    with pytest.raises(ValueError, match="rope_scaling .*: " + re.escape(problem)):
        with_overrides(cfg, {"rope_scaling": scaling})


@pytest.mark.parametrize("factor", ["0", "-2.0"])
def test_a_job_with_a_rope_factor_outside_its_domain_stops_before_anything_is_built(factor, tmp_path):
    from conf.validate import ConfigError
    from tests.jobs_support import job_config
    from trainer.loop import train
    cfg = job_config(tmp_path / "run", f"model.rope_scaling={{rope_type:linear,factor:{factor}}}")
    with pytest.raises(ConfigError, match=f"^model.rope_theta / model.rope_scaling .*factor={factor} must be a number"):
        train(cfg)
    assert not (tmp_path / "run").exists()
