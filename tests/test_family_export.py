"""Qwen2.5 (q/k/v biases), Llama 3.2 (tied embeddings) and Mistral 7B v0.3 through the trainer,
scripts/export.py and the Hugging Face stack: a tiny transformers-made checkpoint trained (LoRA; full
fine-tuning for the tied head, whose gradient reaches the shared weight), exported, loaded by transformers with
our logits, and the adapter loaded by peft's AutoPeftModelForCausalLM with the same logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model import CausalLM, unwrap_model
from scripts.export import export
from tests.data_support import save_tokenizer
from tests.jobs_support import job_config, single_torch_thread  # noqa: F401
from trainer.checkpoint.format import ADAPTER_DIR, load_adapter
from trainer.loop import train

TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
# A high learning rate so a few steps move the weights visibly away from the base.
TRAIN = ["max_steps=3", "optim.lr=1e-2"]
# transformers' class names of each family: <prefix>Config, <prefix>ForCausalLM.
CLASS_PREFIX = {"qwen2": "Qwen2", "llama": "Llama", "mistral": "Mistral"}


def save_base(directory, family: str, tied: bool):
    """A tiny transformers checkpoint of `family` (Qwen2's biases random, not zero) beside a tokenizer."""
    import transformers
    config_class = getattr(transformers, f"{CLASS_PREFIX[family]}Config")
    model_class = getattr(transformers, f"{CLASS_PREFIX[family]}ForCausalLM")
    torch.manual_seed(0)
    config = config_class(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                          rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=2, eos_token_id=3,
                          **({"sliding_window": None} if family == "mistral" else {}))     # v0.3: no window
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def our_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS) @ unwrap_model(model).lm_head.weight.t()


def hf_model(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def run_and_export(tmp_path, base, family: str, mode: str):
    """(checkpoint, export) of a `mode` run on `base` under model.family=`family`, exported by scripts/export.py's
    export (its command line, the same call, runs as a process in test_export.py)."""
    train(job_config(tmp_path / "run", f"train={mode}", f"model.path={base}", f"model.family={family}", *TRAIN))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3"
    return checkpoint, export(checkpoint, tmp_path / "hf")


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("llama", True), ("mistral", False)],
                         ids=["qwen2.5", "llama3.2-tied", "mistral"])
def test_a_lora_run_exports_merged_and_its_adapter_loads_in_peft_with_the_same_logits(tmp_path, family, tied):
    base = save_base(tmp_path / "base", family, tied)
    checkpoint, exported = run_and_export(tmp_path, base, family, "lora")
    expected = our_logits(load_adapter(CausalLM.from_pretrained(str(base), dtype=torch.float32),
                                       checkpoint / ADAPTER_DIR))
    assert not torch.allclose(expected, hf_logits(hf_model(base)), atol=1e-3)     # the adapter changed something
    merged = hf_model(exported)
    assert type(merged).__name__ == f"{CLASS_PREFIX[family]}ForCausalLM"
    torch.testing.assert_close(hf_logits(merged), expected, rtol=1e-4, atol=1e-4)
    weights = load_file(exported / "model.safetensors")
    if tied:    # one weight, stored once, that transformers ties again
        assert "lm_head.weight" not in weights and json.loads((exported / "config.json").read_text())[
            "tie_word_embeddings"] is True
        assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    elif family == "qwen2":     # the biases are merged with the rest of the base
        attention = "model.layers.0.self_attn"
        assert f"{attention}.q_proj.bias" in weights and f"{attention}.o_proj.bias" not in weights
    from peft import AutoPeftModelForCausalLM
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint / ADAPTER_DIR), dtype=torch.float32)
    torch.testing.assert_close(hf_logits(adapter), expected, rtol=1e-4, atol=1e-4)


def test_full_fine_tuning_of_a_tied_head_trains_the_one_shared_weight_and_exports_it_tied(tmp_path):
    """The chunked projection + cross-entropy reads the embedding as the head: its gradient reaches the one
    shared weight, which the checkpoint and the export hold once and transformers ties again."""
    base = save_base(tmp_path / "base", "llama", tied=True)
    checkpoint, exported = run_and_export(tmp_path, base, "llama", "full")
    saved = load_file(checkpoint / "model.safetensors")
    assert "lm_head.weight" not in saved
    before = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.allclose(saved["model.embed_tokens.weight"], before, atol=1e-4)      # it trained
    ours = CausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    merged = hf_model(exported)
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf_logits(merged), our_logits(ours), rtol=1e-4, atol=1e-4)
