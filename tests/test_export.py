"""scripts/export.py and the saved adapter in the Hugging Face stack: merged checkpoints that transformers
loads and that give our model's logits (LoRA on a real base, LoRA on a random init, full fine-tuning), a
complete model directory (tokenizer, generation config, token ids) that AutoTokenizer and pipeline() read,
and adapters that peft's AutoPeftModelForCausalLM loads onto transformers' Llama."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.data_support import save_tokenizer
from tests.jobs_support import REPO, job_config, single_torch_thread  # noqa: F401
from model import CausalLM
from scripts.export import ExportError, export
from storage.checksum import file_checksum
from trainer.checkpoint.format import ADAPTER_DIR, load_adapter
from trainer.loop import train
from model import unwrap_model

TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
# A high learning rate so a few steps move the adapters visibly away from the base.
TRAIN = ["max_steps=3", "optim.lr=1e-2"]
# Token ids of the test tokenizer's <s>, </s> and <pad> (tests.data_support.save_tokenizer).
BOS, EOS, PAD = 2, 3, 1
# What a Hugging Face model directory holds besides its weights and config.json; export copies them.
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def our_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS) @ unwrap_model(model).lm_head.weight.t()


def hf_logits(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def trained_lora(base_dir, checkpoint) -> torch.nn.Module:
    return load_adapter(CausalLM.from_pretrained(str(base_dir), dtype=torch.float32), checkpoint / ADAPTER_DIR)


def auto_peft_logits(checkpoint) -> torch.Tensor:
    """The adapter on transformers' Llama, found by AutoPeftModelForCausalLM from the adapter alone."""
    from peft import AutoPeftModelForCausalLM
    model = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint / ADAPTER_DIR), dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random transformers LlamaForCausalLM with token ids in its config, saved with save_pretrained
    (config.json, generation_config.json, weights) next to a tokenizer trained here."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
                         pad_token_id=PAD)
    directory = tmp_path_factory.mktemp("hf_base")
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def pretrained_lora(tmp_path_factory, hf_base):
    """(checkpoint, export) of a LoRA run on hf_base, exported by the command line."""
    run = tmp_path_factory.mktemp("pretrained_lora")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # as tests.jobs_support.single_torch_thread, for this module-wide run
    try:
        train(job_config(run / "run", "train=lora", f"model.path={hf_base}", *TRAIN))
    finally:
        torch.set_num_threads(threads)
    checkpoint = run / "run" / "checkpoints" / "step-3"
    done = subprocess.run([sys.executable, "scripts/export.py", str(checkpoint), str(run / "hf")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return checkpoint, run / "hf"


def test_lora_on_a_pretrained_base_exports_merged_weights_with_the_same_logits(pretrained_lora, hf_base):
    checkpoint, exported = pretrained_lora
    expected = our_logits(trained_lora(hf_base, checkpoint))
    assert not torch.allclose(expected, hf_logits(hf_base), atol=1e-3)     # the adapter changed something
    torch.testing.assert_close(hf_logits(exported), expected, rtol=1e-4, atol=1e-4)


def test_export_copies_the_tokenizer_generation_config_and_token_ids(pretrained_lora, hf_base):
    from transformers import AutoTokenizer, pipeline
    _, exported = pretrained_lora
    for name in COMPANION_FILES:
        assert (exported / name).read_bytes() == (hf_base / name).read_bytes(), name
    config = json.loads((exported / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    assert tokenizer("the cat sat").input_ids == AutoTokenizer.from_pretrained(str(hf_base))("the cat sat").input_ids
    generate = pipeline("text-generation", model=str(exported), device="cpu")
    reply = generate("the cat sat", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert reply.startswith("the cat sat")


def test_the_adapter_loads_with_auto_peft_onto_transformers_llama(pretrained_lora, hf_base):
    checkpoint, _ = pretrained_lora
    adapter_config = json.loads((checkpoint / ADAPTER_DIR / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(hf_base.resolve())
    assert adapter_config["task_type"] == "CAUSAL_LM" and adapter_config.get("auto_mapping") is None
    torch.testing.assert_close(auto_peft_logits(checkpoint), our_logits(trained_lora(hf_base, checkpoint)),
                               rtol=1e-4, atol=1e-4)


def test_lora_on_a_random_init_merges_into_the_kept_base(tmp_path):
    train(job_config(tmp_path / "run", "train=lora", *TRAIN))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3"
    export(checkpoint, tmp_path / "hf")
    expected = our_logits(trained_lora(tmp_path / "run" / "base_model", checkpoint))
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(auto_peft_logits(checkpoint), expected, rtol=1e-4, atol=1e-4)


def test_full_fine_tuning_exports_the_trained_weights(tmp_path):
    train(job_config(tmp_path / "run", "train=full", *TRAIN))
    export(tmp_path / "run" / "checkpoints" / "step-3", tmp_path / "hf")
    ours = CausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
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
    newest = tmp_path / "run" / "checkpoints" / "step-2"
    with pytest.raises(ExportError, match=f"run directory, not a checkpoint: .* the newest being {newest}$"):
        export(tmp_path / "run", tmp_path / "hf")


def test_a_broken_base_is_one_line_not_a_traceback(pretrained_lora, hf_base, tmp_path):
    import shutil
    checkpoint, _ = pretrained_lora
    base, copy = tmp_path / "base", tmp_path / "step-3"
    shutil.copytree(hf_base, base)
    (base / "config.json").write_text("{ not json")
    shutil.copytree(checkpoint, copy)
    config, marker = copy / "config.yaml", copy / "COMPLETE"
    config.write_text(config.read_text().replace(str(hf_base), str(base)))
    listing = json.loads(marker.read_text())        # a complete checkpoint whose model.path now names `base`
    listing["files"]["config.yaml"] = config.stat().st_size
    listing["crc32"]["config.yaml"] = file_checksum(config)
    marker.write_text(json.dumps(listing))
    done = subprocess.run([sys.executable, "scripts/export.py", str(copy), str(tmp_path / "hf")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("export failed:") and "config.json" in done.stderr


def test_a_random_init_run_exports_without_a_tokenizer_says_so_in_one_line_and_takes_one(tmp_path):
    """A run without model.path has no tokenizer to carry over: export says so and how to add one
    (--tokenizer), and with it pipeline() loads the export."""
    from transformers import pipeline
    train(job_config(tmp_path / "run", "train=full", "max_steps=2"))
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-2")

    def export_command(out: str, *options: str):
        return subprocess.run([sys.executable, "scripts/export.py", checkpoint, str(tmp_path / out), *options],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    bare = export_command("bare")
    assert bare.returncode == 0, bare.stderr
    [note] = [line for line in bare.stdout.splitlines() if "tokenizer" in line]
    assert note.startswith("no tokenizer written: the run had no model.path") and "--tokenizer <dir" in note
    save_tokenizer(tmp_path / "tokenizer")
    done = export_command("hf", "--tokenizer", str(tmp_path / "tokenizer"))
    assert done.returncode == 0 and "no tokenizer" not in done.stdout, done.stderr
    generate = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    assert generate("the cat", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("the cat")
    wrong = export_command("wrong", "--tokenizer", str(tmp_path / "run"))
    assert wrong.returncode == 1 and wrong.stderr.startswith(f"export failed: --tokenizer {tmp_path / 'run'} holds no")
    too_big = tmp_path / "big_tokenizer"        # more tokens than the model's 256 embeddings
    save_tokenizer(too_big, words=[f"w{index}" for index in range(300)])
    refused = export_command("big", "--tokenizer", str(too_big))
    assert refused.returncode == 1 and refused.stderr.strip() == (
        f"export failed: the tokenizer in --tokenizer='{too_big}' has 304 tokens but the model's vocab_size is 256: "
        f"token ids past the embedding would crash; use a checkpoint whose vocab_size covers its tokenizer")
    assert not (tmp_path / "big").exists()


def test_an_export_without_a_tokenizer_says_why(tmp_path):
    from scripts.export import why_no_tokenizer
    (tmp_path / "config.yaml").write_text("model:\n  path: null\n")
    assert why_no_tokenizer(tmp_path) == "the run had no model.path (random init)"
    (tmp_path / "config.yaml").write_text("model:\n  path: /models/bare\n")
    assert why_no_tokenizer(tmp_path) == "the run's model.path=/models/bare holds no tokenizer files"
