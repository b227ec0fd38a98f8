"""conf/capability.py: what a GPU runs (our Hopper kernels, FP8, cuDNN's attention backward), for each GPU
memory.gpu names and for this machine's as this process runs it; and no other module reads a compute capability,
so no two checks can disagree about a GPU."""
import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

from conf.capability import NO_GPU, PRESET_COMPUTE_CAPABILITIES, GpuCapability, gpu_capability
from conf.schema.memory import GPU_PRESETS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("conf", "data", "kernels", "model", "offload", "scripts", "storage", "trainer")
# A raw read of the compute capability: torch's function, or a device's properties' major/minor.
RAW_CAPABILITY = re.compile(r"get_device_capability|\.(major|minor)\b")
# conf/capability.py decides; the tuning cache keys its entries by the raw capability (what the kernels were
# compiled for), which decides nothing.
READS_IT = {"conf/capability.py", "kernels/attention/tuning_cache.py"}


@pytest.mark.parametrize("preset, compute_capability, runs", [
    ("a100_80gb", (8, 0), False),
    ("h100_80gb", (9, 0), True),
    ("h200", (9, 0), True),
])
def test_each_named_gpu(preset, compute_capability, runs):
    """What a plan for memory.gpu=<preset> counts on: the Gluon kernels, FP8 and cuDNN's backward on Hopper."""
    assert gpu_capability(preset) == GpuCapability(preset, compute_capability, hopper=runs, fp8=runs,
                                                   cudnn_attention_backward=runs)


def test_every_named_gpu_has_a_capability():
    assert set(PRESET_COMPUTE_CAPABILITIES) == set(GPU_PRESETS)


def fake_gpu(monkeypatch, name: str, compute_capability: tuple[int, int], cudnn: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: compute_capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn)
    monkeypatch.setattr(torch.backends.cudnn, "enabled", cudnn)
    monkeypatch.delenv("TRITON_OVERRIDE_ARCH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("name, compute_capability, environment, cudnn, hopper, fp8, cudnn_backward", [
    ("NVIDIA H100 80GB HBM3", (9, 0), {}, True, True, True, True),
    ("NVIDIA H100 80GB HBM3", (9, 0), {}, False, True, True, False),                 # cuDNN disabled or absent
    ("NVIDIA H100 80GB HBM3", (9, 0), {"TRITON_OVERRIDE_ARCH": "sm80"}, True, False, True, True),   # A100 code
    ("NVIDIA H100 80GB HBM3", (9, 0), {"TRITON_OVERRIDE_ARCH": "sm90a"}, True, True, True, True),
    ("NVIDIA H100 80GB HBM3", (9, 0), {"TRITON_INTERPRET": "1"}, True, False, True, True),   # no Gluon there
    ("NVIDIA A100-SXM4-80GB", (8, 0), {}, True, False, False, False),
    ("NVIDIA L40S", (8, 9), {}, True, False, False, False),     # Ada: FP8 too, but not the 9.0 measured
    ("NVIDIA B200", (10, 0), {}, True, False, True, True),      # the Gluon kernels are Hopper's (wgmma)
])
def test_this_machines_gpu(monkeypatch, name, compute_capability, environment, cudnn, hopper, fp8, cudnn_backward):
    fake_gpu(monkeypatch, name, compute_capability, cudnn)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert gpu_capability(torch.device("cuda")) == GpuCapability(name, compute_capability, hopper, fp8,
                                                                 cudnn_backward)


def test_no_gpu_off_cuda_or_where_none_is_visible(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    assert gpu_capability(torch.device("cpu")) is NO_GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_capability(torch.device("cuda")) is NO_GPU
    assert not (NO_GPU.hopper or NO_GPU.fp8 or NO_GPU.cudnn_attention_backward)


def test_the_answer_is_a_frozen_value():
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu_capability("h100_80gb").fp8 = False


def raw_reads(files: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if RAW_CAPABILITY.search(line)]


def test_no_other_module_reads_the_compute_capability():
    files = [ROOT / "train.py"] + [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert raw_reads([path for path in files if str(path.relative_to(ROOT)) not in READS_IT]) == []


@pytest.mark.parametrize("source, expected", [
    ("hopper = torch.cuda.get_device_capability(device)[0] == 9\n", 1),
    ("major = torch.cuda.get_device_properties(device).major\n", 1),
    ("hopper = gpu_capability(device).hopper\n", 0),
])
def test_the_check_catches_a_raw_read(tmp_path, monkeypatch, source, expected):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "x.py").write_text(source)
    assert len(raw_reads([tmp_path / "x.py"])) == expected


# "Is the base FP8" (train.fp8 with LoRA): conf.schema.train.fp8_base decides; no other module reads the setting.
READS_FP8 = {"conf/schema/train.py"}


def fp8_setting_reads(path: Path) -> list[int]:
    """Lines of `path` reading a train config's fp8 (`cfg.train.fp8`, `train_cfg.fp8`), found in its syntax tree."""
    import ast
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
            and node.attr == "fp8" and (getattr(node.value, "attr", None) == "train"
                                        or getattr(node.value, "id", None) == "train_cfg")]


def test_whether_the_base_is_fp8_is_decided_in_one_place(tmp_path):
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert {str(path.relative_to(ROOT)) for path in files if fp8_setting_reads(path)} == READS_FP8
    (tmp_path / "x.py").write_text("if cfg.train.fp8:\n    quantize(model)\nlog(f'{train_cfg.fp8}')\n")
    assert fp8_setting_reads(tmp_path / "x.py") == [1, 3]
