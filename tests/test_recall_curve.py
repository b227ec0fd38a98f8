"""scripts/recall_curve.py: the fast-path-against-reference recall job and the FP8-against-bf16 one (--compare
fp8), at a tiny scale on CPU (both runs, the PNG, the summary, the bounds), and the settings they use at 32k
tokens on a GPU (recall_100m, scripts/recall/job.py's recall_recipe and FP8_LORA)."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from conf.schema import register_configs
from conf.schema.data import check_recall
from conf.schema.optim import resolve_optim
from model.config import DecoderConfig
from model.fp8 import check_fp8_widths
from offload.byte_model import parameter_counts
from scripts.recall import job, results
from trainer.step import MAX_ACCURACY_TOKENS

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


def recall_100m_at_32k(*overrides: str):
    register_configs()
    recipe = job.recall_recipe(32768)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["model=recall_100m", "seq_len=32768", "max_steps=300", *recipe,
                                            *overrides])


def summary_of(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_png(path: Path) -> None:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 500 and height > 500


def run_script(*options: str) -> subprocess.CompletedProcess:
    # One thread per process, no interpreter: on CPU the fast run's kernels=auto is the reference, which the
    # interpreter would not change, and a busy 2-core machine makes spinning OpenMP threads slow.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "scripts/recall_curve.py", *options], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


def test_script_runs_both_paths_and_draws_one_png(tmp_path):
    png, root = tmp_path / "curve.png", tmp_path / "runs"
    # A warm start, then both runs at once (--concurrent, as on the GPU).
    options = ["--model", "tiny", "--seq-len", "384", "--steps", str(STEPS), "--device", "cpu", "--batch-size", "2",
               "--log-every", "2", "--concurrent", "--warm-start-steps", "2", "--warm-start-len", "320"]
    done = run_script(*options, "--run-root", str(root), "--out-png", str(png))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = summary_of(done)

    assert_png(png)
    assert summary["png"] == str(png) and summary["device"] == "CPU" and summary["steps"] == STEPS
    # At once: the reference run started before the fast one ended.
    assert done.stdout.index("[reference] ") < done.stdout.index("[fast] exit")
    assert summary["concurrent"] and "the two runs ran at once" in done.stdout
    # Both runs start from the warm start's model, trained at its own length and exported.
    assert summary["warm_start"]["steps"] == 2 and summary["warm_start"]["exit"] == 0
    model_dir = root / job.WARM_START_MODEL
    for name in ("fast", "reference"):
        assert f"loaded tiny from {model_dir}" in (root / name / "train.log").read_text()

    runs = summary["runs"]
    assert set(runs) == {"fast", "reference"}
    for name, run in runs.items():
        assert run["exit"] == 0 and run["steps"] == STEPS, (name, run)
        assert 0.0 <= run["final_accuracy"] <= 1.0 and run["step_s"] > 0, (name, run)
        assert (root / name / "metrics.jsonl").is_file()
    assert runs["fast"]["kernels"] == "auto" and runs["reference"]["kernels"] == "reference"
    # no CUDA: the CPU is the device, nothing offloaded; layer 0's input is looked up again from the embedding
    assert runs["fast"]["plan"]["inputs_gpu"] == 1
    # Same seed, data and steps, and on CPU the same ops (kernels=auto is the reference there): the two
    # curves are one. This checks the script, not the fast path, which only a GPU run exercises.
    assert summary["steps_compared"] == STEPS and summary["max_abs_accuracy_diff"] == 0.0
    assert runs["fast"]["final_loss"] == runs["reference"]["final_loss"]
    assert "| fast | auto |" in done.stdout and "| reference | reference |" in done.stdout
    assert summary["final_loss_rel_diff"] == 0.0 and summary["bounds_hold"] is True

    # --redraw: the same numbers from the run root, without running anything.
    redrawn = run_script(*options, "--redraw", str(root), "--out-png", str(tmp_path / "again.png"))
    assert redrawn.returncode == 0, redrawn.stdout[-3000:] + redrawn.stderr[-3000:]
    again = summary_of(redrawn)
    assert "[fast] " not in redrawn.stdout and (tmp_path / "again.png").is_file()
    for name in ("fast", "reference"):
        assert again["runs"][name]["final_loss"] == runs[name]["final_loss"]
    assert again["warm_start"]["steps"] == 2
    # A run that left no metrics is reported as failed, and the exit status says so.
    (root / "reference" / "metrics.jsonl").unlink()
    failed = run_script(*options, "--redraw", str(root), "--out-png", str(tmp_path / "failed.png"))
    assert failed.returncode == 1 and "| reference | failed (exit 1) |" in failed.stdout, failed.stdout[-2000:]


def test_a_warm_start_on_another_task_or_over_a_given_model_is_refused(tmp_path):
    common = ["--model", "tiny", "--device", "cpu", "--run-root", str(tmp_path / "runs")]
    other_task = run_script(*common, "--seq-len", "8192", "--warm-start-len", "1024")
    assert other_task.returncode != 0 and "--warm-start-len 1024 is below 4096" in other_task.stderr
    given_model = run_script(*common, "--seq-len", "8192", f"model.path={tmp_path}")
    assert given_model.returncode != 0 and "--warm-start-steps 0" in given_model.stderr
    second_arm = run_script(*common, "--second-arm", "train.fp8=false")
    assert second_arm.returncode != 0 and "give it with --compare fp8" in second_arm.stderr
    assert not (tmp_path / "runs").exists()         # refused before anything ran


def test_fast_settings_force_offload_and_kept_attention_on_a_gpu():
    kernels, memory = job.fast_settings(12, on_cuda=True, head_dim=64, kernels=None)
    assert kernels == "triton"
    assert memory == ["memory.gpu_layers=6", "memory.offload=true", "memory.full_layers=2",
                      "memory.kept_attention_layers=null"]
    # Without the Triton attention the trainer refuses kept attention outputs and full layers.
    assert job.fast_settings(2, on_cuda=False, head_dim=16, kernels=None) == (
        "auto", ["memory.gpu_layers=1", "memory.offload=true", "memory.full_layers=0",
                 "memory.kept_attention_layers=0"])
    assert job.fast_settings(2, on_cuda=True, head_dim=16, kernels=None)[0] == "auto"
    # Two layers (recall_100m): one input on the GPU, one offloaded, both attention outputs kept.
    assert job.fast_settings(2, on_cuda=True, head_dim=128, kernels=None) == (
        "triton", ["memory.gpu_layers=1", "memory.offload=true", "memory.full_layers=0",
                   "memory.kept_attention_layers=null"])
    assert job.recall_recipe(512) == []


def test_long_runs_start_from_a_short_warm_start_unless_told_otherwise():
    assert job.warm_start_steps(32768, None) == job.WARM_START_STEPS["paths"] > 0
    # FP8's LoRA runs start from a model that already recalls at 4k: a longer warm start
    assert job.warm_start_steps(32768, None, "fp8") == job.WARM_START_STEPS["fp8"] > job.WARM_START_STEPS["paths"]
    assert job.warm_start_steps(4096, None) == 0
    assert job.warm_start_steps(32768, 0) == 0 and job.warm_start_steps(4096, 7) == 7


def test_recall_100m_is_a_100m_model_the_triton_attention_takes_learning_recall_at_32k():
    cfg = recall_100m_at_32k()
    model = {k: v for k, v in dict(cfg.model).items() if k not in ("name", "path")}
    arch = DecoderConfig(**model)
    total, trainable = parameter_counts(arch, cfg.train)
    assert cfg.train.mode == "full" and trainable == total and 85e6 < total < 115e6, total
    assert arch.head_dim in (64, 128) and arch.num_key_value_heads < arch.num_attention_heads
    assert arch.max_position_embeddings >= 32768
    check_recall(cfg.data, cfg.seq_len, arch.vocab_size)      # raises when the task does not fit
    supervised = cfg.data.num_pairs * (cfg.data.repeats - 1) + cfg.data.num_queries
    assert supervised * cfg.batch_size <= MAX_ACCURACY_TOKENS      # the trainer logs accuracy
    assert cfg.data.repeats == 32768 // job.RECALL_SPACING and cfg.optim.grad_accum_steps == 2
    resolve_optim(cfg)
    assert cfg.optim.lr >= 1e-4         # a from-scratch rate, not the fine-tuning one


def test_the_gpu_named_in_a_run_log_titles_the_figure(tmp_path):
    log = tmp_path / "fast.log"
    log.write_text("  model        recall_100m (random init), train.mode=full, device=cuda:0, kernels=triton, "
                   "gpu=NVIDIA H100 80GB HBM3\n")
    facts = results.run_facts({"exit": 0, "wall_s": 1.0, "records": [], "log": str(log),
                                    "run_dir": str(tmp_path / "fast")})
    assert facts["device"] == "cuda" and facts["kernels"] == "triton" and facts["gpu"] == "NVIDIA H100 80GB HBM3"
    assert results.device_name({"fast": facts}) == "NVIDIA H100 80GB HBM3"
    assert results.device_name({"fast": {"device": "cpu"}}) == "CPU"


def fp8_options(tmp_path, *options: str) -> list[str]:
    return ["--compare", "fp8", "--model", "tiny", "--seq-len", "384", "--device", "cpu", "--batch-size", "2",
            "--log-every", "2", "--concurrent", "--run-root", str(tmp_path / "runs"),
            "--out-png", str(tmp_path / "fp8.png"), *options]


def test_fp8_comparison_trains_lora_twice_from_the_warm_start_and_judges_the_bounds(tmp_path):
    # The FP8 arm's overrides replaced by a no-op: the CPU refuses train.fp8=true, so both arms are bf16 here.
    options = fp8_options(tmp_path, "--steps", str(STEPS), "--warm-start-steps", "2", "--warm-start-len", "320",
                          "--second-arm", "train.fp8=false")
    done = run_script(*options)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary, root = summary_of(done), tmp_path / "runs"
    assert_png(tmp_path / "fp8.png")
    assert summary["compare"] == "fp8" and summary["train"] == "lora" and set(summary["runs"]) == {"bf16", "fp8"}
    # The warm start trains every weight; both arms train LoRA from its export, the second with its overrides.
    assert "train.mode=full" in (root / "warm_start" / "train.log").read_text()
    for name in ("bf16", "fp8"):
        log = (root / name / "train.log").read_text()
        assert "train.mode=lora" in log and f"loaded tiny from {root / job.WARM_START_MODEL}" in log
        command = next(line for line in done.stdout.splitlines() if line.startswith(f"[{name}] train.py"))
        assert " train=lora train.lora_r=32 " in command and ("train.fp8=false" in command) == (name == "fp8")
        run = summary["runs"][name]
        assert run["exit"] == 0 and run["steps"] == STEPS and run["step_s"] > 0
        records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        assert run["final_loss_mean"] == sum(r["loss"] for r in records) / STEPS     # fewer than 50 steps: all
        assert run["final_loss"] == records[-1]["loss"] and 0 <= run["final_accuracy_mean"] <= 1
    # Identical arms: no difference, the bounds hold, in the JSON and the table.
    assert summary["final_loss_rel_diff"] == 0.0 and summary["final_accuracy_abs_diff"] == 0.0
    assert summary["last_loss_rel_diff"] == 0.0 and summary["bounds_hold"] is True
    assert "(bound 1%: holds)" in done.stdout and "(bound 0.02: holds)" in done.stdout

    redrawn = run_script(*options, "--redraw", str(root))
    assert redrawn.returncode == 0 and "[bf16] " not in redrawn.stdout, redrawn.stdout[-2000:]
    assert summary_of(redrawn)["runs"]["fp8"]["final_loss_mean"] == summary["runs"]["fp8"]["final_loss_mean"]

    # The second arm's losses 5% above the first's: both runs finished, the bounds fail, and so does the gate.
    metrics = root / "fp8" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(r | {"loss": r["loss"] * 1.05}) + "\n" for r in records))
    failed = run_script(*options, "--redraw", str(root))
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert summary_of(failed)["bounds_hold"] is False and "(bound 1%: FAILS)" in failed.stdout
    assert all(run["exit"] == 0 for run in summary_of(failed)["runs"].values())


def test_the_fp8_arm_fails_on_the_cpu_with_the_trainers_refusal(tmp_path):
    done = run_script(*fp8_options(tmp_path, "--steps", "2", "--warm-start-steps", "0"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train.fp8=true needs a CUDA GPU with FP8 tensor cores" in done.stdout      # its log, echoed
    summary = summary_of(done)
    assert summary["runs"]["fp8"]["exit"] != 0 and summary["runs"]["bf16"]["exit"] == 0
    assert summary["bounds_hold"] is None and "| fp8 | failed (exit" in done.stdout


def test_the_final_differences_hold_issue_41s_bounds_or_not():
    def facts(loss, accuracy):
        return {"final_loss_mean": loss, "final_loss": loss, "final_accuracy_mean": accuracy,
                "final_accuracy": accuracy}
    within = results.final_differences({"bf16": facts(2.0, 0.8), "fp8": facts(2.019, 0.785)})
    assert abs(within["final_loss_rel_diff"] - 0.0095) < 1e-9 and within["bounds_hold"] is True
    loss_off = results.final_differences({"bf16": facts(2.0, 0.8), "fp8": facts(1.97, 0.8)})
    assert not loss_off["loss_within_bound"] and loss_off["accuracy_within_bound"] and not loss_off["bounds_hold"]
    accuracy_off = results.final_differences({"bf16": facts(2.0, 0.8), "fp8": facts(2.0, 0.77)})
    assert accuracy_off["loss_within_bound"] and not accuracy_off["bounds_hold"]
    assert results.final_differences({"bf16": facts(2.0, 0.8), "fp8": {}}) == {"bounds_hold": None}


def test_the_fp8_runs_at_32k_are_lora_on_every_projection_with_widths_fp8_takes():
    cfg = recall_100m_at_32k(*job.FP8_LORA, job.FP8_ARM)
    assert cfg.train.mode == "lora" and cfg.train.fp8 and len(cfg.train.lora_target_modules) == 7
    assert cfg.optim.lr == 1e-3 and cfg.train.lora_r >= 16
    arch = DecoderConfig(**{k: v for k, v in dict(cfg.model).items() if k not in ("name", "path")})
    assert check_fp8_widths(arch.hidden_size, arch.num_attention_heads * arch.head_dim,
                            arch.num_key_value_heads * arch.head_dim, arch.intermediate_size) is None
