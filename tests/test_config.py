"""Hydra composition and the cross-field checks that run before any model is built."""
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
    result = subprocess.run([sys.executable, "train.py", "max_steps=3", f"output_dir={run_dir}",
                             "logger.wandb.mode=disabled"], capture_output=True, text=True, cwd=repo, timeout=120)
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
