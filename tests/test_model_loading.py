"""Loading local HF checkpoints: sharded or not, and clear errors for broken directories and damaged files."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from model import HFCheckpointError, CausalLM
from tests.jobs_support import FAST, REPO

TINY = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, model_type="llama")


def write_checkpoint(path, shards: int = 1, with_index: bool = True):
    model = CausalLM.from_config(TINY)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    (path / "config.json").write_text(json.dumps(TINY))
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[shard::shards]}
        save_file(part, str(path / file))
        weight_map.update({name: file for name in part})
    if with_index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model


@pytest.mark.parametrize("shards,with_index", [(1, False), (3, True), (2, False)])
def test_sharded_checkpoints_load_identically(tmp_path, shards, with_index):
    original = write_checkpoint(tmp_path, shards, with_index)
    loaded = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_dtype_is_applied(tmp_path):
    write_checkpoint(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(HFCheckpointError, match="nowhere"):
        CausalLM.from_pretrained(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    with pytest.raises(HFCheckpointError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path)


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(HFCheckpointError, match="no \\*.safetensors"):
        CausalLM.from_pretrained(tmp_path)


def test_missing_shard_named_by_index(tmp_path):
    write_checkpoint(tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="model-00002-of-00002.safetensors"):
        CausalLM.from_pretrained(tmp_path)


def test_missing_tensor_is_listed(tmp_path):
    write_checkpoint(tmp_path, shards=2, with_index=False)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="missing .* tensors"):
        CausalLM.from_pretrained(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "intermediate_size": 64}))
    with pytest.raises(HFCheckpointError, match="mlp.*shape"):
        CausalLM.from_pretrained(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="not valid JSON"):
        CausalLM.from_pretrained(tmp_path)


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def garble_header(file):
    file.write_bytes(b"\xff" * 16 + file.read_bytes()[16:])


@pytest.mark.parametrize("damage", [truncate, garble_header])
def test_truncated_or_garbled_shard_is_named(tmp_path, damage):
    write_checkpoint(tmp_path, shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    damage(shard)
    with pytest.raises(HFCheckpointError, match=f"{shard}.*truncated or damaged"):
        CausalLM.from_pretrained(tmp_path)


def test_garbled_index_is_named(tmp_path):
    write_checkpoint(tmp_path, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    with pytest.raises(HFCheckpointError, match="model.safetensors.index.json is not valid JSON"):
        CausalLM.from_pretrained(tmp_path)


def test_train_py_reports_a_damaged_shard_in_one_line(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_checkpoint(checkpoint, shards=2)
    first, second = sorted(checkpoint.glob("*.safetensors"))
    truncate(first)
    garble_header(second)
    done = subprocess.run([sys.executable, "train.py", *FAST, f"output_dir={tmp_path / 'run'}",
                           f"model.path={checkpoint}", "train=lora"], cwd=REPO, capture_output=True, text=True)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "ERROR" in line or first.name in line]
    assert len(errors) == 1 and first.name in errors[0], output
