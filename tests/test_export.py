"""scripts/export.py: merged Hugging Face checkpoints that transformers loads and that give our model's
logits, for LoRA on a real base, LoRA on a random init, and full fine-tuning."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.jobs_support import REPO, job_config, single_torch_thread  # noqa: F401
from model import Llama
from scripts.export import ExportError, export
from trainer.loop import train
from model import unwrap_llama

TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
# A high learning rate so a few steps move the adapters visibly away from the base.
TRAIN = ["max_steps=3", "optim.lr=1e-2"]


def our_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS) @ unwrap_llama(model).lm_head.weight.t()


def hf_logits(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def trained_lora(base_dir, checkpoint) -> torch.nn.Module:
    from peft import PeftModel
    return PeftModel.from_pretrained(Llama.from_pretrained(str(base_dir), dtype=torch.float32), checkpoint / "adapter")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random transformers LlamaForCausalLM, saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=10000.0, tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("hf_base")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_lora_on_a_pretrained_base_exports_merged_weights_with_the_same_logits(tmp_path, hf_base):
    train(job_config(tmp_path / "run", "train=lora", f"model.path={hf_base}", *TRAIN))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3"
    done = subprocess.run([sys.executable, "scripts/export.py", str(checkpoint), str(tmp_path / "hf")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected = our_logits(trained_lora(hf_base, checkpoint))
    assert not torch.allclose(expected, hf_logits(hf_base), atol=1e-3)     # the adapter changed something
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), expected, rtol=1e-4, atol=1e-4)


def test_lora_on_a_random_init_merges_into_the_kept_base(tmp_path):
    train(job_config(tmp_path / "run", "train=lora", *TRAIN))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3"
    export(checkpoint, tmp_path / "hf")
    expected = our_logits(trained_lora(tmp_path / "run" / "base_model", checkpoint))
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), expected, rtol=1e-4, atol=1e-4)


def test_full_fine_tuning_exports_the_trained_weights(tmp_path):
    train(job_config(tmp_path / "run", "train=full", *TRAIN))
    export(tmp_path / "run" / "checkpoints" / "step-3", tmp_path / "hf")
    ours = Llama.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "run" / "checkpoints" / "step-3" / "model.safetensors")
    assert all(torch.equal(ours.state_dict()[name], tensor) for name, tensor in saved.items())
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), our_logits(ours), rtol=1e-4, atol=1e-4)


def test_export_refuses_what_it_cannot_do_without_touching_anything(tmp_path):
    train(job_config(tmp_path / "run", "train=lora", "max_steps=2", "checkpoint.save_random_base=false"))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    with pytest.raises(ExportError, match="save_random_base"):
        export(checkpoint, tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export(checkpoint, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="COMPLETE marker"):
        export(tmp_path / "run" / "checkpoints", tmp_path / "hf")
