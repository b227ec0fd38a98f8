"""Hydra composition and the cross-field checks that run before any model is built."""
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from pathlib import Path

from conf.schema import register_configs
from conf.validate import ConfigError, validate

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def make_config(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_is_tiny_full_finetune_on_recall():
    cfg = make_config()
    assert (cfg.model.name, cfg.train.mode, cfg.data.name) == ("tiny", "full", "recall")
    validate(cfg)


def test_llama3_8b_long_context_parses():
    cfg = make_config("model=llama3_8b", "seq_len=65536")
    assert cfg.seq_len == 65536 and cfg.model.hidden_size == 4096 and cfg.train.mode == "lora"
    assert cfg.model.rope_scaling is None


def test_llama3_1_has_rope_scaling():
    cfg = make_config("model=llama3_1_8b")
    assert cfg.model.rope_scaling["rope_type"] == "llama3" and cfg.model.rope_scaling["factor"] == 8.0


def test_command_line_train_mode_beats_model_default():
    assert make_config("train=lora").train.mode == "lora"


def test_types_are_checked():
    with pytest.raises(Exception, match="seq_len"):
        make_config("seq_len=long")


@pytest.mark.parametrize("override,message", [
    ("optim.warmup_steps=5000", "warmup_steps=5000 must be below max_steps"),
    ("seq_len=0", "seq_len=0 must be at least 1"),
    ("kernels=cuda", "kernels='cuda' is not one of"),
    ("device=tpu", "device='tpu' is not one of"),
    ("model.path=/no/such/checkpoint", "model.path='/no/such/checkpoint' is not a directory"),
    ("data.num_queries=40", "data.num_queries \\(40\\) must be between 1 and data.num_pairs"),
    ("seq_len=16", "seq_len=16 is too short"),
    ("model.vocab_size=64", "needs model.vocab_size >= "),
    ("model.num_key_value_heads=3", "must be a multiple of model.num_key_value_heads=3"),
    ("train.mode=partial", "train.mode='partial' is not one of"),
    ("memory.gpu_layers=-1", "memory.gpu_layers=-1 must be at least 0"),
    ("max_bad_steps=0", "max_bad_steps=0 must be at least 1"),
    ("optim.grad_accum_steps=0", "optim.grad_accum_steps=0 must be at least 1"),
    ("logger.peak_tflops=0", "logger.peak_tflops=0.0 must be positive .* or null for its datasheet peak"),
])
def test_invalid_combinations_name_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(override))


def test_triton_kernels_without_gpu_are_rejected_before_building(monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernels=triton needs a CUDA GPU"):
        validate(make_config("kernels=triton"))


def test_cuda_device_without_gpu_is_rejected():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        validate(make_config("device=cuda"))


def test_train_py_reports_a_bad_setting_in_one_line_and_exits_2(tmp_path):
    """A user's mistake gets its message and the fix, not a traceback, and nothing is built or written."""
    import subprocess
    import sys
    repo = Path(CONF_DIR).parent
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "max_steps=3", "optim.warmup_steps=30",
                             f"output_dir={run_dir}", "logger.wandb.mode=disabled"],
                            capture_output=True, text=True, cwd=repo, timeout=120)
    assert result.returncode == 2
    assert "optim.warmup_steps=30 must be below max_steps=3" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (run_dir / "checkpoints").exists()


def test_conf_imports_no_other_project_package_nor_hydra():
    """Any package may import conf cheaply: conf needs none of them, and Hydra/OmegaConf only on use."""
    import subprocess
    import sys
    code = ("import sys, conf.schema, conf.validate; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'kernels', 'data', 'model', 'offload', 'trainer', 'hydra', 'omegaconf'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(CONF_DIR).parent, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_kernels_backend_check(monkeypatch):
    from conf.schema.job import check_kernels_backend
    check_kernels_backend("reference")
    with pytest.raises(ConfigError, match="kernels='cuda' is not one of"):
        check_kernels_backend("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_kernels_backend("triton")


# --- issue 15: keys outside the schema, warmup defaults, where mode and rate come from, output_dir ---

@pytest.mark.parametrize("override,message", [
    ("+optim.warmup=3", "unknown setting optim.warmup: the nearest is optim.warmup_steps"),
    ("+optim.learning_rate=5e-5", "unknown setting optim.learning_rate: the nearest is optim.lr "
                                  "\\(optim has: name, lr, "),
    ("+warmup_steps=5", "unknown setting warmup_steps: the nearest is optim.warmup_steps"),
    ("+logger.wandb.projct=x", "unknown setting logger.wandb.projct: the nearest is logger.wandb.project"),
])
def test_keys_outside_the_schema_are_errors_naming_the_nearest(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(override))


def test_a_misspelt_key_without_plus_names_the_nearest_valid_key_not_hydras_advice(tmp_path):
    """Hydra would stop with "To append to your config use +optim.learnig_rate=1e-4"."""
    done = subprocess.run([sys.executable, "train.py", "optim.learnig_rate=1e-4", f"output_dir={tmp_path / 'run'}"],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("unknown setting optim.learnig_rate: the nearest is optim.lr (optim has: name, lr, "
                                   "betas, eps, weight_decay, warmup_steps, min_lr_ratio, grad_clip, grad_accum_steps)")
    assert not (tmp_path / "run").exists()


def test_free_form_dict_settings_take_any_key():
    validate(make_config("model=llama3_1_8b", "+model.rope_scaling.new_knob=1", "train=lora"))


def test_negative_warmup_is_rejected():
    with pytest.raises(ConfigError, match="optim.warmup_steps=-1 must be >= 0"):
        validate(make_config("optim.warmup_steps=-1"))


@pytest.mark.parametrize("model,max_steps,warmup", [("tiny", 1, 0), ("tiny", 25, 2), ("tiny", 600, 30),
                                                    ("llama3_8b", 15, 1), ("llama3_8b", 100, 20)])
def test_default_warmup_is_capped_below_a_short_run(model, max_steps, warmup, caplog):
    cfg = make_config(f"model={model}", f"max_steps={max_steps}")
    with caplog.at_level("INFO"):
        validate(cfg)
    assert cfg.optim.warmup_steps == warmup
    assert ("optim.warmup_steps" in caplog.text) == (warmup < 20)


def test_explicit_warmup_conflicting_with_max_steps_stays_an_error():
    with pytest.raises(ConfigError, match="optim.warmup_steps=5 must be below max_steps=3"):
        validate(make_config("max_steps=3", "optim.warmup_steps=5"))


@pytest.mark.parametrize("overrides,expected", [
    ([], ["train.mode=full (model=tiny's default: it trains from random init, every parameter; train=lora for "
          "adapters)",
          "optim.lr=0.001 (model=tiny's from-scratch rate)"]),
    (["train=lora"], ["train.mode=lora (chosen over model=tiny's default train=full)",
                      "optim.lr=0.0002 (the LoRA rate)"]),
    (["model=llama3_8b"], ["train.mode=lora (the default; train=full for every parameter)",
                           "optim.lr=0.0002 (the LoRA rate)", "optim.warmup_steps=20 (the default)"]),
    (["model=llama3_8b", "train=full"], ["train.mode=full (train=full; the default is train=lora)",
                                         "optim.lr=1e-05 (the full fine-tuning rate)"]),
    (["optim.lr=3e-3", "optim.warmup_steps=7"], ["optim.lr=0.003 (set)", "optim.warmup_steps=7 (set)"]),
])
def test_the_training_line_says_which_mode_and_rate_were_taken_and_why(overrides, expected):
    training = validate(make_config(*overrides))
    for text in expected:
        assert text in training


def test_a_checkpoint_with_the_tiny_model_is_told_it_gets_the_from_scratch_rate(tmp_path):
    training = validate(make_config(f"model.path={tmp_path}"))
    assert "optim.lr=0.001 (model=tiny's from-scratch rate; set optim.lr to fine-tune model.path)" in training
    assert (f"train.mode=full (model=tiny's default: it fine-tunes model.path={tmp_path}, every parameter; "
            f"train=lora for adapters)") in training and "random init" not in training


def test_a_short_run_trains_with_the_capped_warmup_and_saves_it(tmp_path, caplog):
    from tests.jobs_support import job_config, records
    from trainer.loop import train
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO"):
        train(job_config(run_dir, "max_steps=1", "optim.warmup_steps=null"))
    assert "warmup_steps: 0" in (run_dir / "config.yaml").read_text()
    assert records(run_dir)[0]["lr"] == pytest.approx(1e-3)     # the full rate at once: no warmup
    assert "optim.lr=0.001" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("output_dir,message", [("{file}/run", "output_dir='{file}/run' is under the file"),
                                                ("{file}", "output_dir='{file}' is a file")])
def test_an_output_dir_that_cannot_be_a_directory_is_named(tmp_path, output_dir, message):
    (tmp_path / "file").write_text("")
    path, expected = (text.format(file=tmp_path / "file") for text in (output_dir, message))
    with pytest.raises(ConfigError, match=expected):
        validate(make_config(f"output_dir={path}"))


def run_train_py(*overrides: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "train.py", "logger.wandb.mode=disabled", *overrides],
                          capture_output=True, text=True, cwd=Path(CONF_DIR).parent, timeout=120)


@pytest.mark.parametrize("output_dir,bad,message", [
    ("{tmp}/run", "+foo=1", "unknown setting foo"),
    ("/proc/x", "optim.warmup_steps=1", "output_dir='/proc/x' cannot be created"),
    ("{tmp}/run", "optim.lr=inf", "optim.lr=inf must be a finite number"),
    ("{tmp}/run", "seed=-1", "seed=-1 must be within [0, 4294967295]"),
])
def test_a_rejected_run_leaves_no_directory_behind(tmp_path, output_dir, bad, message):
    """Validation, the output_dir check included, runs before anything is written: no run directory, no
    .hydra/ or train.log anywhere; the error is one line, the last."""
    run_dir = Path(output_dir.format(tmp=tmp_path))
    result = run_train_py(f"output_dir={run_dir}", bad)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert message in output.strip().splitlines()[-1] and output.count("[ERROR]") == 1, output
    assert not run_dir.exists() and not (Path(CONF_DIR).parent / ".hydra").exists()


# --- issue 40: non-finite numbers, seeds, gradient clipping, nearest keys ---

def float_settings() -> list[str]:
    """Every float setting of the schema (float, Optional[float], List[float]), by its dotted path."""
    import typing
    from conf.schema import JobConfig
    from conf.validate import nested_schema

    def walk(schema, prefix=""):
        for name, hint in typing.get_type_hints(schema).items():
            if nested := nested_schema(hint):
                yield from walk(nested, f"{prefix}{name}.")
            elif float in (hint, *typing.get_args(hint)):
                yield prefix + name
    return list(walk(JobConfig))


def test_every_float_setting_is_found():
    assert {"optim.lr", "optim.betas", "optim.grad_clip", "memory.gpu_memory_gib", "checkpoint.every_minutes",
            "logger.peak_tflops", "model.rope_theta"} <= set(float_settings())


@pytest.mark.parametrize("number", ["nan", "inf", "-inf"])
def test_every_float_setting_refuses_nan_and_inf(number):
    for setting in float_settings():
        value = f"[0.9,{number}]" if setting == "optim.betas" else number
        with pytest.raises(ConfigError, match=f"^{setting.replace('.', '[.]')}=.*must be a finite number"):
            validate(make_config(f"{setting}={value}"))
    with pytest.raises(ConfigError, match=f"^model[.]rope_scaling[.]factor={number} must be a finite number"):
        validate(make_config(f"model.rope_scaling={{rope_type:yarn,factor:{number},original_max_position_embeddings:"
                             f"8192}}"))


@pytest.mark.parametrize("seed", [0, 1234, 2**32 - 1])
def test_seeds_in_the_documented_range_are_taken(seed):
    validate(make_config(f"seed={seed}"))


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seeds_outside_the_documented_range_are_one_line(seed):
    with pytest.raises(ConfigError, match=f"^seed={seed} must be within \\[0, 4294967295\\]$"):
        validate(make_config(f"seed={seed}"))


def test_negative_grad_clip_is_an_error_and_zero_turns_clipping_off():
    with pytest.raises(ConfigError, match="optim.grad_clip=-1.0 must be >= 0 \\(0 turns clipping off\\)"):
        validate(make_config("optim.grad_clip=-1"))
    validate(make_config("optim.grad_clip=0"))


@pytest.mark.parametrize("override", ["+foo=1", "+foo.bar=1"])
def test_a_key_near_no_valid_one_gets_no_nearest(override):
    with pytest.raises(ConfigError, match="^unknown setting foo \\(the top level has: model, data, optim, "):
        validate(make_config(override))
