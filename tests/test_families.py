"""Model families (model/family.py, model/families/): each family's model equals transformers' class for it
(fp32, positions past the original context, a changed rope), checkpoints are recognised by their
config.json, windowed attention is refused, and a family defined in one place trains through the trainer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import CausalLM, DecoderConfig, HFCheckpointError
from model.families import FAMILIES, register_family
from model.family import LayerOps, ModelFamily
from tests.jobs_support import REPO, job_config, losses, single_torch_thread  # noqa: F401
from trainer.loop import train

VOCAB = 101
# The original context is 32 positions; the inputs run to 90, so every rope scaling is exercised past it.
CONTEXT, LENGTH = 32, 90
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT}
# Llama 3.1/3.2's rope type (their factor is 32 over 8192; scaled down to this context).
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": CONTEXT}


def hf_classes(family: str):
    import transformers
    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]


def save_hf(directory, family: str, rope: dict | None = None, tied: bool = False, head_dim: int = 32):
    """A tiny transformers model of `family` with sharp attention (q and k scaled, so a wrong rope or a missing
    QK-norm changes the logits visibly), non-trivial norms and biases (Qwen2's, zero as initialised), saved
    with save_pretrained."""
    config_class, model_class = hf_classes(family)
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                          max_position_embeddings=4 * CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                          rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})},
                          **({"sliding_window": None} if family == "mistral" else {}))     # v0.3's: no window
    torch.manual_seed(0)
    hf = model_class(config).float()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                param.uniform_(-1.0, 1.0)
            if "q_proj" in name or "k_proj" in name:
                param.mul_(4.0)
    hf.save_pretrained(directory)
    return hf


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    labels[0, :7] = -100
    return ids, labels


def our_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids) @ model.lm_head.weight.t()


CASES = [  # (family, the checkpoint's rope, our override of it, tied embeddings, head_dim)
    pytest.param("qwen3", YARN, None, False, 32, id="qwen3-yarn-head_dim-apart"),       # 4 x 32 != 64 wide
    pytest.param("qwen3", None, YARN, True, 16, id="qwen3-tied-yarn-override"),
    pytest.param("llama", None, YARN, False, 16, id="llama-yarn-override"),
    pytest.param("llama", LLAMA3, None, True, 16, id="llama3.2-tied-llama3-rope"),
    pytest.param("qwen2", YARN, None, False, 16, id="qwen2-bias-yarn"),
    pytest.param("qwen2", None, YARN, True, 16, id="qwen2-bias-tied-yarn-override"),
    pytest.param("mistral", None, YARN, False, 16, id="mistral-yarn-override"),
]


@pytest.mark.parametrize("family, rope, override, tied, head_dim", CASES)
def test_logits_and_every_gradient_equal_transformers(tmp_path, family, rope, override, tied, head_dim):
    """fp32, 90 positions over a 32-position original context, with the checkpoint's own rope or one
    overridden as context extension does (the transformers model is then built with that rope)."""
    hf = save_hf(tmp_path / "base", family, rope, tied, head_dim)
    if override:
        hf = save_hf(tmp_path / "reference", family, override, tied, head_dim)
    overrides = {"rope_scaling": override} if override else None
    ours = CausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32, overrides=overrides)
    assert ours.config.family == family
    ids, labels = inputs()

    reference = hf(ids).logits
    F.cross_entropy(reference.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    logits = our_logits(ours, ids)
    ours.loss(ours(ids), labels).backward()

    assert (logits - reference).abs().max().item() <= 1e-5
    ref_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert our_params.keys() == ref_params.keys()
    for name, param in our_params.items():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert (param.grad - ref_params[name].grad).abs().max().item() <= 1e-5, name


def test_a_missing_qk_norm_or_a_wrong_rope_changes_the_logits_visibly(tmp_path):
    hf = save_hf(tmp_path, "qwen3", YARN)
    ids, _ = inputs()
    with torch.no_grad():
        reference = hf(ids).logits
        ours = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert (our_logits(ours, ids) - reference).abs().max() <= 1e-5
        wrong_rope = CausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                              overrides={"rope_scaling": {"rope_type": "default"}})
        no_qk_norm = CausalLM.from_config(DecoderConfig(**{**vars(ours.config), "family": "llama"}))
        state = {k: v for k, v in ours.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
        no_qk_norm.load_state_dict(state)
        for changed in (wrong_rope, no_qk_norm):
            difference = (our_logits(changed, ids) - reference).norm() / reference.norm()
            assert difference > 0.05


SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def hf_config_values(family: str, **values) -> dict:
    config_class, model_class = hf_classes(family)
    return {**config_class(**SHAPE).to_dict(), "architectures": [model_class.__name__], **values}


@pytest.mark.parametrize("values", [
    pytest.param({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
                 id="mistral-v0.1"),
    pytest.param({"model_type": "gemma2", "sliding_window": 4096}, id="gemma2"),
    pytest.param({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4096,
                  "layer_types": ["full_attention", "sliding_attention"]}, id="qwen3-window-on"),
])
def test_a_window_that_is_on_is_refused_in_one_line(tmp_path, values):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **values}))
    with pytest.raises(HFCheckpointError) as refused:
        CausalLM.from_pretrained(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "windowed (sliding_window=4096)" in message and "config.json" in message


def test_a_window_present_but_switched_off_is_not_refused():
    """Qwen2.5 and Qwen3 keep sliding_window in config.json with use_sliding_window false."""
    values = hf_config_values("qwen3", sliding_window=131072, use_sliding_window=False, max_window_layers=28)
    assert DecoderConfig.from_dict(values).family == "qwen3"
    values = hf_config_values("qwen3", sliding_window=4096, use_sliding_window=True, max_window_layers=2,
                              layer_types=["full_attention", "full_attention"])     # no layer windowed
    assert DecoderConfig.from_dict(values).family == "qwen3"


def test_qwen2_5_and_mistral_v0_3_configs_load_and_a_mistral_window_by_default_is_refused():
    """Qwen2.5-7B's config.json keeps a window it switches off; Mistral v0.3's writes sliding_window null, and
    MistralConfig's default window (4096, v0.1's) applies to a config.json that leaves the key out."""
    qwen2_5 = hf_config_values("qwen2", sliding_window=131072, use_sliding_window=False, max_window_layers=28,
                               rope_theta=1000000.0, max_position_embeddings=32768)
    assert DecoderConfig.from_dict(qwen2_5).family == "qwen2"
    mistral = hf_config_values("mistral", sliding_window=None)
    assert DecoderConfig.from_dict(mistral).family == "mistral"
    del mistral["sliding_window"]
    with pytest.raises(ValueError, match=r"windowed \(sliding_window=4096\)"):
        DecoderConfig.from_dict(mistral)


def test_a_missing_bias_or_an_untied_head_changes_the_logits_visibly(tmp_path):
    """Qwen2's q/k/v biases and a tied head are read: without them the logits are far from transformers'."""
    hf = save_hf(tmp_path, "qwen2", tied=True, head_dim=16)
    ids, _ = inputs()
    with torch.no_grad():
        reference = hf(ids).logits
        ours = CausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert (our_logits(ours, ids) - reference).abs().max() <= 1e-5
        no_bias = CausalLM.from_config(DecoderConfig(**{**vars(ours.config), "family": "llama"}))
        no_bias.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.endswith("bias")})
        untied = CausalLM.from_config(DecoderConfig(**{**vars(ours.config), "tie_word_embeddings": False}))
        untied.load_state_dict({k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}, strict=False)
        for changed in (no_bias, untied):
            difference = (our_logits(changed, ids) - reference).norm() / reference.norm()
            assert difference > 0.05


def test_an_unknown_family_or_an_option_not_built_is_refused():
    with pytest.raises(ValueError, match=r"model_type='phi3', which is not a model family built here: llama"):
        DecoderConfig.from_dict({"model_type": "phi3"})
    with pytest.raises(ValueError, match=r"attention_bias=True is not supported for qwen3"):
        DecoderConfig.from_dict(hf_config_values("qwen3", attention_bias=True))
    with pytest.raises(ValueError, match=r"model family 'qwen9' is not one of llama, mistral, qwen2, qwen3"):
        DecoderConfig(family="qwen9")


def test_the_export_config_is_the_family_class(tmp_path):
    """config.json of our model names transformers' class of its family, which builds the same model."""
    save_hf(tmp_path / "base", "qwen3", YARN)
    ours = CausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    values = ours.config.to_hf_dict()
    assert values["model_type"] == "qwen3" and values["architectures"] == ["Qwen3ForCausalLM"]
    assert DecoderConfig.from_dict(values) == ours.config


def test_model_path_picks_the_family_and_a_different_one_given_is_an_error_naming_it(tmp_path, caplog):
    from conf.validate import ConfigError
    from trainer.architecture import model_architecture, record_architecture
    save_hf(tmp_path / "base", "qwen3")
    cfg = job_config(tmp_path / "run", f"model.path={tmp_path / 'base'}")      # model=tiny: a llama group
    assert record_architecture(cfg).family == "qwen3" and cfg.model.family == "qwen3"
    assert "model.family=llama (built: qwen3)" in caplog.text
    cfg = job_config(tmp_path / "run", f"model.path={tmp_path / 'base'}", "model.family=llama")
    with pytest.raises(ConfigError, match=r"^model.family=llama differs from qwen3 in model.path's config.json"):
        model_architecture(cfg, given_keys={"family"})


def test_a_family_the_settings_name_but_nobody_built_is_one_line():
    from conf.validate import ConfigError
    from trainer.architecture import architecture
    cfg = job_config(Path("/nonexistent"), "model.family=qwen9")
    with pytest.raises(ConfigError, match=r"^model.family='qwen9': model family 'qwen9' is not one of llama, "):
        architecture(cfg.model)


@pytest.fixture
def test_family():
    """A family defined in this one place: Llama's layer with QK-norm, under a model type of its own."""
    family = register_family(ModelFamily(name="qk_llama_test", model_types=("qk_llama_test",),
                                         hf_architecture="LlamaForCausalLM", layer=LayerOps(qk_norm=True)))
    yield family
    del FAMILIES[family.name]


def test_a_family_defined_in_one_place_trains_through_the_trainer(tmp_path, test_family):
    """The test-only family trains (full fine-tuning, so its QK-norm weights learn), checkpoints and resumes
    to the same losses as a straight run: config, planner, policy, checkpoints all read the family."""
    overrides = ["model.family=qk_llama_test", "max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=2"]
    straight = train(job_config(tmp_path / "straight", *overrides))
    assert straight["step"] == 4
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "straight" / "checkpoints" / "step-4" / "model.safetensors")
    assert "model.layers.0.self_attn.q_norm.weight" in weights
    assert not torch.equal(weights["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))
    train(job_config(tmp_path / "resumed", *overrides[:-2], "max_steps=2", "checkpoint.every_steps=2"))
    train(job_config(tmp_path / "resumed", *overrides))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def test_qwen2_trains_its_biases_and_resumes_through_the_trainer(tmp_path):
    """model.family=qwen2 (random init, full fine-tuning): the q/k/v biases train from zero, are checkpointed,
    and a resumed run takes the straight run's losses."""
    overrides = ["model.family=qwen2", "max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=2"]
    train(job_config(tmp_path / "straight", *overrides))
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "straight" / "checkpoints" / "step-4" / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    train(job_config(tmp_path / "resumed", *overrides[:-2], "max_steps=2", "checkpoint.every_steps=2"))
    train(job_config(tmp_path / "resumed", *overrides))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_on_our_gpu_kernels_against_the_fp32_reference():
    """A Qwen3 of real head width (128: the Triton/Gluon attention, QK-norm through the Triton RMSNorm over
    [tokens x heads] rows, fused RoPE and SwiGLU, chunked cross-entropy) in bf16 against the same model in fp32
    on the reference ops: loss, and every gradient by relative norm."""
    import kernels
    config = DecoderConfig(family="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1024,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                           rope_scaling=YARN, max_position_embeddings=4 * CONTEXT)
    torch.manual_seed(0)
    reference = CausalLM.from_config(config, dtype=torch.float32, device="cuda")
    ours = CausalLM.from_config(config, dtype=torch.bfloat16, device="cuda")
    ours.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    ids = torch.randint(0, 1000, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    labels = ids.roll(-1, dims=1)
    backend = kernels.get_backend()
    try:
        kernels.set_backend("reference")
        expected = reference.loss(reference(ids), labels)
        expected.backward()
        kernels.set_backend("auto")
        loss = ours.loss(ours(ids), labels)
        loss.backward()
    finally:
        kernels.set_backend(backend)
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) / expected.item() < 1e-2
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        ref_grad = ref_params[name].grad
        error = (param.grad.float() - ref_grad).norm() / ref_grad.norm()
        assert torch.isfinite(param.grad).all() and error < 5e-2, (name, float(error))


TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


def qwen3_checkpoint(directory):
    """A tiny transformers Qwen3 (QK-norm, head_dim apart from hidden/heads) with the recall task's vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def logits_of(model) -> torch.Tensor:
    from model import unwrap_model
    with torch.no_grad():
        return model(TOKENS) @ unwrap_model(model).lm_head.weight.t()


def transformers_logits(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)(TOKENS).logits


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_qwen3_trains_evaluates_resumes_and_exports_through_the_trainer(tmp_path, mode):
    """A Qwen3 checkpoint trained through the trainer (evaluated every 2 steps, interrupted at step 2 and
    resumed to the straight run's losses), then exported: the merged model loads in transformers as
    Qwen3ForCausalLM with our logits, and a LoRA adapter loads with peft onto transformers' Qwen3 alike."""
    from scripts.export import export
    from trainer.checkpoint.format import ADAPTER_DIR, load_adapter
    base = qwen3_checkpoint(tmp_path / "base")
    job = [f"train={mode}", f"model.path={base}", "optim.lr=1e-2", "eval.every_steps=2",
           "checkpoint.every_steps=2", "checkpoint.keep_last=3"]
    train(job_config(tmp_path / "straight", *job, "max_steps=4"))
    train(job_config(tmp_path / "resumed", *job, "max_steps=2"))
    train(job_config(tmp_path / "resumed", *job, "max_steps=4"))
    from tests.jobs_support import records

    def step_losses(run):
        return [record["loss"] for record in records(run) if "loss" in record]
    assert len(step_losses(tmp_path / "straight")) == 4
    assert step_losses(tmp_path / "resumed") == step_losses(tmp_path / "straight")
    assert [record["step"] for record in records(tmp_path / "straight") if "eval/loss" in record] == [0, 2, 4]

    checkpoint = tmp_path / "straight" / "checkpoints" / "step-4"
    export(checkpoint, tmp_path / "hf")      # its command line, the same call, runs as a process in test_export.py
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    if mode == "lora":
        ours = logits_of(load_adapter(CausalLM.from_pretrained(base, dtype=torch.float32), checkpoint / ADAPTER_DIR))
        from peft import AutoPeftModelForCausalLM
        adapter = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint / ADAPTER_DIR), dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(adapter(TOKENS).logits, ours, rtol=1e-4, atol=1e-4)
    else:
        ours = logits_of(CausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32))
    assert not torch.allclose(ours, transformers_logits(base), atol=1e-3)       # training changed the model
    torch.testing.assert_close(transformers_logits(tmp_path / "hf"), ours, rtol=1e-4, atol=1e-4)


def test_a_family_lives_in_the_files_the_architecture_doc_lists():
    """docs/ARCHITECTURE.md's "Adding a model family" lists what a family touches: Qwen3 is named nowhere else
    in the product but in the shared files that describe or measure the built-in families (comments)."""
    import re
    from pathlib import Path
    root = Path(REPO)
    section = (root / "docs" / "ARCHITECTURE.md").read_text().split("## Adding a model family")[1].split("\n## ")[0]
    listed = {path.replace("<family>", "qwen3").replace("<group>", "qwen3_8b")
              for path in re.findall(r"^- `([^`]+)`", section, flags=re.M)}
    assert {"model/families/qwen3.py", "model/families/__init__.py", "conf/model/qwen3_8b.yaml"} <= listed
    assert all((root / path).exists() for path in listed)
    # Files that name the built-in families in comments or docstrings, or measure them.
    describing = {"model/family.py", "model/decoder.py", "conf/schema/model.py", "scripts/bench_train.py",
                  "scripts/gpu_session.sh", "scripts/experiments/qknorm_bench.py", "scripts/experiments/norm_ab.sh"}
    product = [path for package in ("conf", "data", "kernels", "model", "offload", "storage", "trainer", "scripts")
               for path in (root / package).rglob("*") if path.suffix in (".py", ".yaml", ".sh")]
    naming = {str(path.relative_to(root)) for path in product if "qwen3" in path.read_text().lower()}
    assert naming - describing == listed & naming
