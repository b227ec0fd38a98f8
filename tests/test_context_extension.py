"""Context extension on top of model.path: rope overrides change the model that is built and are recorded
wherever the model is described (config.yaml, checkpoints, W&B, the export's config.json, the adapter's
base), a resume refuses a changed rope, other architecture settings that differ from the checkpoint are
errors, and the startup summary warns when seq_len outgrows an unchanged rope."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from conf.validate import ConfigError, validate
from model import CausalLM
from scripts.export import export
from tests.data_support import checkpoint, text_file  # noqa: F401  (fixtures)
from tests.jobs_support import FAST, REPO, job_config, single_torch_thread, train_process  # noqa: F401
from model.hf_checkpoint import read_config
from trainer.architecture import context_summary, record_architecture
from trainer.checkpoint.format import ADAPTER_DIR, CheckpointError, load_adapter
from trainer.checkpoint.resume import config_differences
import trainer.loop
from trainer.loop import train

CONTEXT = 64             # the checkpoint's max_position_embeddings; the jobs train at seq_len 128 (FAST)
YARN = "model.rope_scaling={rope_type: yarn, factor: 2.0}"
TOKENS = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def short_base(tmp_path_factory):
    """A tiny transformers Llama trained (so to speak) at a 64-token context, with sharp attention so that a
    rope change shows in its logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
    directory = tmp_path_factory.mktemp("short_base")
    model.save_pretrained(directory)
    return directory


def logits(model) -> torch.Tensor:
    from model import unwrap_model
    with torch.no_grad():
        return model(TOKENS) @ unwrap_model(model).lm_head.weight.t()


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def recorded_model(path) -> dict:
    return yaml.safe_load(path.read_text())["model"]


@pytest.fixture(scope="module")
def extended_run(tmp_path_factory, short_base):
    """A LoRA run on short_base with a yarn override, through the command line (the dict syntax), and its
    export."""
    run = tmp_path_factory.mktemp("extended") / "run"
    done = subprocess.run([sys.executable, "train.py", *FAST, f"output_dir={run}", "train=lora", "max_steps=2",
                           "optim.lr=1e-2", f"model.path={short_base}", YARN, "model.max_position_embeddings=128"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    step = run / "checkpoints" / "step-2"
    export(step, run.parent / "hf")
    return run, step, run.parent / "hf"


def test_a_rope_override_is_built_recorded_and_exported(extended_run, short_base):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM
    run, step, exported = extended_run
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": CONTEXT}
    for config_yaml in (run / "config.yaml", step / "config.yaml"):
        recorded = recorded_model(config_yaml)
        assert (recorded["rope_scaling"], recorded["max_position_embeddings"]) == (yarn, 128)
        assert (recorded["hidden_size"], recorded["rope_theta"]) == (128, 10000.0)      # the checkpoint's
    summary = (run / "train.log").read_text()
    assert "changed from model.path's: model.rope_scaling, model.max_position_embeddings" in summary

    # The adapter names a base with the new rope: peft's loader applies it, and gives our model's logits,
    # which differ from the same adapter on the checkpoint's own rope.
    adapter_config = json.loads((step / ADAPTER_DIR / "adapter_config.json").read_text())
    base = adapter_config["base_model_name_or_path"]
    assert json.loads((run / "base_model" / "config.json").read_text())["rope_scaling"] == yarn
    assert base == str((run / "base_model").resolve())
    ours = logits(load_adapter(CausalLM.from_pretrained(base, dtype=torch.float32), step / ADAPTER_DIR))
    on_old_rope = logits(load_adapter(CausalLM.from_pretrained(short_base, dtype=torch.float32), step / ADAPTER_DIR))
    assert (ours - on_old_rope).abs().max() > 1e-2
    peft = AutoPeftModelForCausalLM.from_pretrained(str(step / ADAPTER_DIR), dtype=torch.float32)
    torch.testing.assert_close(hf_logits(peft), ours, rtol=1e-4, atol=1e-4)

    # The merged export carries the rope and length; transformers loads it with our logits.
    exported_config = json.loads((exported / "config.json").read_text())
    assert (exported_config["rope_scaling"], exported_config["max_position_embeddings"]) == (yarn, 128)
    merged = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    torch.testing.assert_close(hf_logits(merged), ours, rtol=1e-4, atol=1e-4)


def test_w_and_b_records_the_architecture_built(tmp_path, short_base, monkeypatch):
    recorded = {}
    monkeypatch.setattr(trainer.loop, "open_wandb", lambda wandb_cfg, run_dir, config, run_id:
                        recorded.update(config["model"]))
    train(job_config(tmp_path / "run", "max_steps=2", f"model.path={short_base}", "model.rope_theta=40000"))
    assert (recorded["rope_theta"], recorded["max_position_embeddings"], recorded["vocab_size"]) == (40000.0, 64, 256)


def test_resume_refuses_a_changed_rope_and_the_summary_warned(tmp_path, short_base, caplog):
    run = tmp_path / "run"
    caplog.set_level(logging.INFO)
    train(job_config(run, "max_steps=2", f"model.path={short_base}"))
    # seq_len 128 on a 64-token checkpoint with its rope unchanged: one line says so and what would help.
    warnings = [line for line in caplog.text.splitlines() if "WARNING: seq_len=128" in line]
    assert len(warnings) == 1 and "beyond model.path's max_position_embeddings 64" in warnings[0]
    assert ("model.rope_scaling='{rope_type: yarn, factor: 2, original_max_position_embeddings: 64}' "
            "model.max_position_embeddings=128, or model.rope_theta=") in warnings[0]
    with pytest.raises(CheckpointError, match="model.rope_theta: checkpoint 10000.0, now 40000.0"):
        train(job_config(run, "max_steps=3", f"model.path={short_base}", "model.rope_theta=40000"))
    assert train(job_config(run, "max_steps=3", f"model.path={short_base}", "model.rope_theta=40000",
                            "resume_force=true"))["step"] == 3


def test_a_run_that_recorded_its_model_group_still_resumes(short_base):
    """Runs before the architecture was recorded saved the model group's values beside model.path."""
    older = job_config(REPO / "unused", f"model.path={short_base}")
    assert older.model.num_attention_heads == 8 and older.model.max_position_embeddings is None    # tiny's
    now = job_config(REPO / "unused", f"model.path={short_base}")
    record_architecture(now)
    assert now.model.num_attention_heads == 4 and now.model.max_position_embeddings == CONTEXT
    assert config_differences(OmegaConf.to_yaml(older), now) == []
    now.model.rope_theta = 40000.0
    assert config_differences(OmegaConf.to_yaml(older), now) == ["model.rope_theta: checkpoint 10000.0, now 40000.0"]


def test_an_override_changes_the_model_and_other_architecture_keys_are_refused(short_base):
    plain = CausalLM.from_pretrained(short_base, dtype=torch.float32)
    longer = CausalLM.from_pretrained(short_base, dtype=torch.float32, overrides={"rope_theta": 40000.0})
    assert (logits(plain) - logits(longer)).abs().max() > 1e-2
    cfg = job_config(REPO / "unused", f"model.path={short_base}", "model.hidden_size=64")
    validate(cfg)
    with pytest.raises(ConfigError, match="model.hidden_size=64 differs from 128 in model.path's config.json"):
        record_architecture(cfg)


def test_rope_overrides_apply_to_a_random_init_too():
    cfg = job_config(REPO / "unused", "model=llama3_8b", "seq_len=65536", "model.rope_scaling="
                     "{rope_type: yarn, factor: 8.0, original_max_position_embeddings: 8192}")
    validate(cfg)
    arch = record_architecture(cfg)
    assert arch.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert cfg.model.rope_theta == 500000.0 and cfg.model.max_position_embeddings == 8192
    assert context_summary(cfg).startswith("yarn (factor 8.0, original_max_position_embeddings 8192)")
    # A scaling given over model=llama3_1_8b's replaces its llama3 scaling (Hydra merges the two dicts).
    cfg = job_config(REPO / "unused", "model=llama3_1_8b", "model.rope_scaling={rope_type: linear, factor: 4.0}")
    assert record_architecture(cfg).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_data_summary_counts_trained_positions_beyond_the_context(text_file, tmp_path, checkpoint, caplog):
    from data.documents import trained_positions
    from data.files import build_file_source
    from tests.data_support import files_config
    caplog.set_level(logging.INFO)
    stream = build_file_source(files_config(text_file, tmp_path), 16, 2, 0, 64, str(checkpoint), trained_context=4)
    assert "document lengths: p50 6, p90 10, p99 10, longest 10" in caplog.text
    # Documents of 9, 8, 3, 5, 4, 6, 10 tokens, all trained on: labels at positions 0 .. length-2, of which
    # those at 4 and beyond count: 4 + 3 + 0 + 0 + 0 + 1 + 5.
    assert trained_positions(stream.documents, 16, "split", 4) == (38, 13)
    assert "34.2% of trained tokens (13) are at positions beyond model.path's context of 4" in caplog.text
    caplog.clear()
    build_file_source(files_config(text_file, tmp_path), 16, 2, 0, 64, str(checkpoint), trained_context=12)
    assert "no trained token is at a position beyond model.path's context of 12" in caplog.text



def variant(short_base, directory, **changes):
    """short_base's weights (linked) beside its config.json with `changes`, in the older rope_scaling layout."""
    for file in short_base.iterdir():
        if file.name != "config.json":
            (directory / file.name).symlink_to(file)
    config = json.loads((short_base / "config.json").read_text())
    config.pop("rope_parameters", None)
    (directory / "config.json").write_text(json.dumps(config | {"rope_theta": 10000.0, **changes}))
    return directory


@pytest.fixture(scope="module")
def linear_base(tmp_path_factory, short_base):
    """short_base's weights under a linear rope scaling (its config.json's)."""
    return variant(short_base, tmp_path_factory.mktemp("linear_base"),
                   rope_scaling={"rope_type": "linear", "factor": 4.0})


def test_the_default_rope_given_over_a_scaled_checkpoint_is_built(linear_base, short_base):
    from trainer.build import build_model, checked_plan
    cfg = job_config(REPO / "unused", f"model.path={linear_base}", "model.rope_scaling={rope_type: default}")
    validate(cfg)
    assert record_architecture(cfg).rope_type == "default"
    device = torch.device("cpu")
    built = build_model(cfg, device, checked_plan(cfg, device)).model.float()
    assert built.config.rope_scaling is None
    default = CausalLM.from_pretrained(short_base, dtype=torch.float32)
    scaled = CausalLM.from_pretrained(linear_base, dtype=torch.float32)
    assert (logits(default) - logits(scaled)).abs().max() > 1e-2
    torch.testing.assert_close(logits(built), logits(default))


# The model section c729dfe's trainer wrote into config.yaml for model=tiny with model.path (its schema's
# max_position_embeddings and rope_theta beside the group's values; the checkpoint's config.json was built).
C729DFE_MODEL = """\
model:
  name: tiny
  path: {path}
  vocab_size: 256
  hidden_size: 128
  intermediate_size: 384
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: null
  max_position_embeddings: 8192
  rms_norm_eps: 1.0e-05
  rope_theta: 10000.0
  rope_scaling: null
  tie_word_embeddings: false
"""


def as_c729dfe_wrote_it(step, path) -> None:
    """`step`'s config.yaml with the model section an unrecorded run saved, its COMPLETE marker updated."""
    from storage.checksum import file_checksum
    config, marker = step / "config.yaml", step / "COMPLETE"
    saved = yaml.safe_load(config.read_text())
    saved["model"] = yaml.safe_load(C729DFE_MODEL.format(path=path))["model"]
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    listing = json.loads(marker.read_text())
    listing["files"]["config.yaml"] = config.stat().st_size
    listing["crc32"]["config.yaml"] = file_checksum(config)
    marker.write_text(json.dumps(listing))


def test_a_run_saved_before_the_architecture_was_recorded_exports_and_resumes(tmp_path, short_base):
    """Its max_position_embeddings 8192 is the schema's, not an override: the checkpoint's 128 was built."""
    (tmp_path / "base").mkdir()
    base = variant(short_base, tmp_path / "base", rope_theta=40000.0, max_position_embeddings=128)
    run = tmp_path / "run"
    train(job_config(run, "max_steps=2", "train=full", f"model.path={base}"))
    as_c729dfe_wrote_it(run / "checkpoints" / "step-2", base)
    exported = json.loads((export(run / "checkpoints" / "step-2", tmp_path / "hf") / "config.json").read_text())
    assert (exported["rope_theta"], exported["max_position_embeddings"]) == (40000.0, 128)
    assert train(job_config(run, "max_steps=3", "train=full", f"model.path={base}"))["step"] == 3


def test_an_extended_adapter_exports_with_its_rope_without_base_model(extended_run, tmp_path):
    """A run directory without base_model/ (not copied along): the merge still takes the run's rope."""
    import shutil
    from transformers import AutoModelForCausalLM
    _, step, exported = extended_run
    copy = tmp_path / "run" / "checkpoints" / "step-2"
    shutil.copytree(step, copy)
    again = export(copy, tmp_path / "hf")
    assert json.loads((again / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
    merged = [AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32) for path in (exported, again)]
    torch.testing.assert_close(hf_logits(merged[1]), hf_logits(merged[0]), rtol=0, atol=0)


def test_a_setting_equal_to_the_model_groups_is_still_the_users(tmp_path, short_base):
    """model=tiny sets rope_theta 10000 and 8 heads: given on train.py's command line, they count."""
    (tmp_path / "base").mkdir()
    base = variant(short_base, tmp_path / "base", rope_theta=500000.0)
    run = tmp_path / "run"
    done = train_process(run, "max_steps=2", f"model.path={base}", "model.rope_theta=10000")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert recorded_model(run / "config.yaml")["rope_theta"] == 10000.0
    done = train_process(tmp_path / "refused", "max_steps=2", f"model.path={base}", "model.num_attention_heads=8")
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "model.num_attention_heads=8 differs from 4" in output, output[-3000:]


def test_without_the_command_line_the_group_values_dropped_are_named(short_base, caplog):
    cfg = job_config(REPO / "unused", f"model.path={short_base}")
    record_architecture(cfg)
    assert "replaces model=tiny's model.num_attention_heads=8 (built: 4)" in caplog.text


def test_a_start_reads_model_paths_config_once(tmp_path, short_base, monkeypatch):
    import trainer.architecture
    reads = []
    monkeypatch.setattr(trainer.architecture, "read_config", lambda path: reads.append(path) or read_config(path))
    trainer.architecture.read_checkpoint_config.cache_clear()
    train(job_config(tmp_path / "run", "max_steps=2", f"model.path={short_base}", "model.rope_theta=40000"))
    assert len(reads) == 1
