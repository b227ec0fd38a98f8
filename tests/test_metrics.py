"""The metrics record (metrics.jsonl, extra sources, MFU) and the PNG report drawn from it."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kernels
from model.config import DecoderConfig
from model.decoder import CausalLM
from tests.jobs_support import REPO, job_config, records, single_torch_thread  # noqa: F401
from scripts.report import report
from trainer.architecture import group_values
from trainer.console import step_line
from trainer.loop import train
from trainer.metrics import FlopPeaks, MetricsLog, flop_peaks, mfu_metrics, step_flops


LORA = SimpleNamespace(mode="lora", lora_r=16, fp8=False, lora_target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
FULL = SimpleNamespace(mode="full", fp8=False)
H100 = flop_peaks("NVIDIA H100 80GB HBM3")


def architecture(group: str, **changes) -> DecoderConfig:
    return DecoderConfig.from_dict({**group_values(group), **changes})


def test_llama3_8b_count_by_hand_and_the_issues_figure():
    # Per token: 6 × (32 layers of q, o (4096²), k, v (8 KV heads of 128) and the MLP, plus the output projection)
    # + 6 × layers × heads × head_dim × S, the causal half of the square.
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    per_token = 6 * (32 * layer + 4096 * 128256) + 6 * 32 * 32 * 128 * 32768
    llama = architecture("llama3_8b")
    assert step_flops(llama, FULL, seq_len=32768, sequences=2) == 2 * 32768 * per_token
    # Issue 48's check: 7,672 tok/s at 32k is 54.9% of the H100's 989 TFLOP/s; LoRA r=16's adapters add their
    # 6 × 41.9M weights a token (0.2 points); the measured ceiling's figure is the same work over 795.
    assert mfu_metrics(32768 * per_token, 32768 / 7672, H100)["mfu"] == pytest.approx(0.549, abs=5e-4)
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    lora = mfu_metrics(step_flops(llama, LORA, 32768, 1), 32768 / 7672, H100)
    assert step_flops(llama, LORA, 32768, 1) == 32768 * (per_token + 6 * adapters)
    assert lora["mfu"] == pytest.approx(0.551, abs=5e-4)
    assert lora["mfu_measured_ceiling"] == pytest.approx(lora["mfu"] * 989 / 795)


def test_qwen3_count_by_hand_with_its_own_head_dim_and_tied_embedding():
    # Qwen3-0.6B: 16 query heads of 128 (2048 wide) over a 1024-wide residual, 8 KV heads, the output projection
    # tied to the input embedding and counted once.
    qwen = architecture("qwen3_8b", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, tie_word_embeddings=True)
    layer = 1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072
    per_token = 6 * (28 * layer + 1024 * 151936) + 6 * 28 * 16 * 128 * 4096
    assert step_flops(qwen, FULL, seq_len=4096, sequences=1) == 4096 * per_token


def test_the_embedding_lookup_is_not_counted():
    # Llama-3.2-1B ties its output projection to the input embedding: the count is the untied model's, and a
    # bigger vocabulary adds its output projection's 6 × hidden a word, not the lookup's too.
    tied = architecture("llama3_2_1b")
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192
    per_token = 6 * (16 * layer + 2048 * 128256) + 6 * 16 * 32 * 64 * 8192
    assert step_flops(tied, FULL, 8192, 1) == 8192 * per_token
    assert step_flops(architecture("llama3_2_1b", tie_word_embeddings=False), FULL, 8192, 1) == 8192 * per_token
    bigger = architecture("llama3_2_1b", vocab_size=128256 + 1000)
    assert step_flops(bigger, FULL, 8192, 1) - step_flops(tied, FULL, 8192, 1) == 8192 * 6 * 2048 * 1000


def test_a_four_layer_8b_model_reports_no_mfu_above_100_percent():
    """The products a full fine-tuning step of the model executes, counted by PyTorch's FlopCounterMode on the
    reference path (meta tensors: shapes only), are the count: the attention's over the whole square, which our
    kernels run over its causal half, and no product for the embedding lookup. So the fastest step the GPU's
    datasheet allows, every product at its peak, reports at most 100%."""
    four_layers = architecture("llama3_8b", num_hidden_layers=4)
    backend = kernels.get_backend()
    kernels.set_backend("reference")
    try:
        with torch.device("meta"):
            model = CausalLM(four_layers)
            input_ids = torch.zeros(1, 32768, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            model.loss(model(input_ids), input_ids).backward()
    finally:
        kernels.set_backend(backend)
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert set(counts) == {"aten.mm", "aten.bmm"}           # projections; attention's scores and outputs
    flops = step_flops(four_layers, FULL, 32768, 1)
    assert flops == counts["aten.mm"] + counts["aten.bmm"] // 2
    fastest = flops / (H100.datasheet * 1e12)
    assert mfu_metrics(flops, fastest, H100)["mfu"] <= 1.0
    assert mfu_metrics(flops, 1.25 * fastest, H100)["mfu"] == pytest.approx(0.8)


def test_peaks_by_gpu_and_none_on_cpu():
    assert H100 == FlopPeaks(datasheet=989.0, measured=795.0)
    assert flop_peaks("NVIDIA H200") == FlopPeaks(datasheet=989.0)
    assert flop_peaks("NVIDIA A100-SXM4-80GB") == FlopPeaks(datasheet=312.0)
    assert flop_peaks("NVIDIA H100 PCIe") == FlopPeaks()                        # a lower peak, not in the table
    assert flop_peaks("NVIDIA H100 PCIe", configured=756.0) == FlopPeaks(datasheet=756.0)
    assert flop_peaks(None, configured=756.0) == FlopPeaks()                    # CPU
    assert mfu_metrics(989e12, 1.0, H100) == {"mfu": 1.0, "mfu_measured_ceiling": 989 / 795}
    assert mfu_metrics(989e12, 1.0, FlopPeaks()) == {"mfu": None, "mfu_measured_ceiling": None}
    line = step_line({"step": 1, "applied": True, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-4, "tokens_per_s": 7672.0,
                      "mfu": 0.551, "mfu_measured_ceiling": 0.686, "gpu_peak_gib": 69.2}, max_steps=3)
    assert "tok/s 7672 mfu 55.1% (measured ceiling 68.6%) gpu peak" in line


def test_metrics_log_adds_sources_writes_strict_json_and_forgets_lost_steps(tmp_path):
    log = MetricsLog(tmp_path, resumed_step=0)
    log.add_source(lambda: {"offload/pinned_gib": 1.5})
    for step in (1, 2, 3):
        record = log.write(step, {"loss": float("nan") if step == 2 else 1.0 / step})
    assert record["offload/pinned_gib"] == 1.5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1], parse_constant=lambda name: math.nan)["loss"] is None   # no bare NaN

    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 4, "lo')        # the process was killed mid-line
    MetricsLog(tmp_path, resumed_step=2)      # resumed from a step-2 checkpoint: step 3 is redone
    assert [r["step"] for r in records(tmp_path)] == [1, 2]


def test_training_records_every_step_and_report_draws_pngs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.console")
    final = train(job_config(tmp_path, "max_steps=3"))
    [startup] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("job\n")]
    assert " FLOPs a step; MFU only on a GPU\n" in startup
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s", "host_rss_gib",
                 "tokens_seen", "skipped_steps"):
        assert steps[-1][name] is not None, name
    assert steps[-1]["mfu"] is None and steps[-1]["mfu_measured_ceiling"] is None      # CPU
    assert final["loss"] == steps[-1]["loss"]
    assert step_line(final, 3).startswith("step 3/3 loss ")

    done = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert "3 steps recorded" in done.stdout
    for name in ("report_loss.png", "report_throughput.png", "report_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_a_directory_without_metrics_says_what_to_give(tmp_path):
    with pytest.raises(SystemExit, match="give the output_dir of a training run"):
        report(tmp_path)
