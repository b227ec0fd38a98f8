"""The CUDA allocator cap (trainer.allocator): a plan made for a smaller GPU than the one present (memory.gpu,
memory.gpu_memory_gib) holds the allocator to that GPU's size. The decision is a pure function; the CUDA
calls are stood in for only where this machine has no GPU."""
import pytest
import torch

from conf.schema.memory import GPU_PRESETS
from offload.units import GIB
from trainer import allocator

H100, H200 = int(GPU_PRESETS["h100_80gb"] * GIB), int(GPU_PRESETS["h200"] * GIB)


def test_the_cap_is_the_planned_share_of_a_bigger_gpu_and_none_otherwise():
    assert allocator.memory_cap_fraction(H100, H200) == pytest.approx(79.2 / 139.8)
    assert allocator.memory_cap_fraction(H200, H200) is None       # the plan is this GPU's own
    assert allocator.memory_cap_fraction(H200, H100) is None       # a bigger plan than the GPU: nothing to cap
    assert allocator.memory_cap_fraction(0, H200) is None


def test_no_cap_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", pytest.fail)
    allocator.cap_gpu_memory(H100, torch.device("cpu"))
    assert allocator.gpu_cap_note(H100, torch.device("cpu")) == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for a GPU only where none is present")
@pytest.mark.parametrize("present,capped", [(H200, True), (H100, False)])
@pytest.mark.parametrize("device", [torch.device("cuda", 1), torch.device("cuda")])   # bench_train's has no index
def test_an_h100_plan_on_an_h200_caps_the_allocator_once_and_says_so(monkeypatch, present, capped, device):
    calls = []
    monkeypatch.setattr(allocator, "present_gpu_memory", lambda device: present)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    allocator.cap_gpu_memory(H100, device)
    note = allocator.gpu_cap_note(H100, device)
    if capped:
        assert calls == [(pytest.approx(79.2 / 139.8), 1)]
        assert note == ("; CUDA allocator capped at 79.2 of this GPU's 139.8 GiB (memory.gpu / "
                        "memory.gpu_memory_gib), so the plan's GPU is what runs")
    else:
        assert calls == [(1.0, 1)] and note == ""      # the whole GPU: no cap left by an earlier job


@pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for a GPU only where none is present")
def test_a_later_sweep_job_without_a_cap_lifts_the_earlier_jobs(monkeypatch):
    fractions = []
    monkeypatch.setattr(allocator, "present_gpu_memory", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, index: fractions.append(
        fraction))
    allocator.cap_gpu_memory(H100, torch.device("cuda", 0))      # job 1: memory.gpu=h100_80gb
    allocator.cap_gpu_memory(H200, torch.device("cuda", 0))      # job 2, in the same process: the H200's own
    assert fractions == [pytest.approx(79.2 / 139.8), 1.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for a GPU only where none is present")
def test_the_training_benchmark_takes_the_same_cap(monkeypatch):
    from scripts.bench_train import cap_to_planned_gpu, trainer_config
    calls = []
    monkeypatch.setattr(allocator, "present_gpu_memory", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg = trainer_config(8192, ["memory.gpu=h100_80gb"])
    assert cap_to_planned_gpu(cfg, torch.device("cuda")) == pytest.approx(79.2 / 139.8)
    assert calls == [(pytest.approx(79.2 / 139.8), 0)]
