"""The training loop: config in, trained model and a run directory out.

Run directory (output_dir): run.lock, config.yaml, train.log, metrics.jsonl, checkpoints/step-<N>/, wandb/,
and for LoRA on a random init base_model/. The parts that make a long job trustworthy live in small modules:
trainer.run_dir (created once, one writer),
trainer.checkpoint.manager (crash-safe checkpoints), trainer.checkpoint.resume (which one to continue from),
trainer.signals (SIGTERM/SIGINT), trainer.guard (NaN/Inf steps), trainer.metrics, trainer.wandb_run and
trainer.console (what is recorded and shown).

A job runs in three parts: start_job (resume, build, restore) returns a Job holding what the steps need,
run_steps trains (each step: run_step, the hooks of Job.after_step, record_step, checkpoint_after), and
finish_job closes the records and shows the end summary.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import OmegaConf

import kernels
from conf.schema.job import resolve_device
from conf.validate import validate
from data import DataError, build_data, preflight_data
from offload.byte_model import Capacity
from offload.plan import MemoryPlan
from offload.units import GIB
from storage.atomic import disk_is_full
from trainer.allocator import cap_gpu_memory, gpu_cap_note
from trainer.architecture import context_summary, model_architecture, record_architecture, trained_context
from trainer.build import (Built, build_model, checked_plan, count_parameters, keep_extended_base,
                           release_sequence_group)
from trainer.checkpoint.format import Progress
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.resume import agreed_checkpoint, check_same_shapes, keep_started_warmup, tidy_checkpoints
from trainer.console import ProgressBar, RunLog, end_summary, logging_to_run_dir, quiet_rank, startup_summary
from trainer.distributed import World, close_world, init_world, local_rank, rank_device, ranks_per_host
from trainer.evaluate import Evaluator, build_evaluator, check_passkey, eval_line, evaluate_at_start
from trainer.guard import BadStepCounter
from trainer.metrics import (FlopPeaks, MetricsLog, flop_peaks, memory_metrics, mfu_metrics, reset_peak_memory,
                             step_flops, wait_for_device)
from trainer.optim import build_optimizer, build_scheduler
from trainer.run_dir import accept_run, create_run_dir, keep_random_base, one_writer
from trainer.sharding import shard_model, sharding
from trainer.signals import StopSignals
from trainer.step import train_step
from trainer.wandb_run import open_wandb

log = logging.getLogger(__name__)

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def planned_memory(plan: MemoryPlan, device: torch.device) -> str:
    return (f"{plan.device_label} peak {plan.gpu_peak / GIB:.2f} of {plan.capacity.gpu_limit / GIB:.2f} GiB usable, "
            f"host peak {plan.host_peak / GIB:.2f} GiB, pinned {plan.pinned / GIB:.2f} GiB (details above)"
            + gpu_cap_note(plan.capacity.gpu, device))


def add_memory_engine_sources(metrics_log: MetricsLog, built: Built, device: torch.device) -> None:
    """Per step: the memory engine's offload numbers (pinned GiB, copy GB/s, share of copy time hidden behind
    compute) and, on GPU, the planner's predicted peak to compare with the measured gpu_peak_gib."""
    metrics_log.add_source(built.policy.stats)
    if device.type == "cuda":
        metrics_log.add_source(lambda: {"gpu_planned_peak_gib": built.plan.gpu_peak / GIB})


def gpu_name(device: torch.device) -> str:
    """", gpu=<name>" on a CUDA device (the run's log then says which GPU its step times are from), else ""."""
    return f", gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""


def train(cfg, given_keys: set[str] | None = None, overrides: list[str] | None = None) -> dict:
    """Train to cfg.max_steps, or until SIGTERM/SIGINT (then checkpoint and return); returns the last
    step's metrics, with `stopped_by` (the signal's number) when a signal stopped it (train.py exits with
    it). Under torchrun every process runs this, as one rank of the job (trainer.distributed). `given_keys`:
    the model settings the command line gave (trainer.architecture.given_model_keys); `overrides`: a sweep
    job's, kept in its run directory."""
    auto_warmup = cfg.optim.warmup_steps is None
    training = validate(cfg)
    record_architecture(cfg, given_keys=given_keys)
    preflight_data(cfg.data, cfg.model.path, cfg.eval.path)
    check_passkey(cfg)
    device = rank_device(resolve_device(cfg.device))
    world = init_world(cfg.parallel.sequence, device)
    try:
        kernels.set_backend(cfg.kernels)
        seed_everything(cfg.seed)
        # A job that cannot fit stops before writing anything.
        plan = checked_plan(cfg, device, capacity=agreed_capacity(cfg, device, world))
        cap_gpu_memory(plan.capacity.gpu, device)      # a plan for a smaller GPU than this one: hold it to that
        # One run directory for all ranks: the default output_dir is resolved from each process's clock.
        cfg.output_dir = world.main_value(str(cfg.output_dir))
        run_dir = Path(cfg.output_dir)
        world.on_main(lambda: create_run_dir(run_dir))
        with (one_writer(run_dir, world),
              logging_to_run_dir(run_dir) if world.is_main else quiet_rank(world.rank) as run_log):
            return run_job(cfg, training, device, plan, run_dir, auto_warmup, world, run_log, overrides)
    finally:
        close_world(world)


@dataclasses.dataclass
class Job:
    """A started job: what its steps need, built by start_job, run by run_steps, closed by finish_job."""
    cfg: Any
    world: World
    device: torch.device
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: Any
    progress: Progress
    checkpoints: CheckpointManager
    config_yaml: str
    step_flops: float
    flop_peaks: FlopPeaks
    guard: BadStepCounter
    bar: ProgressBar
    metrics_log: MetricsLog | None     # rank 0 only, as wandb_run
    wandb_run: Any
    last_checkpoint: Path | None
    first_step: int
    # Called as hook(job, step, metrics) on every rank after each step, before its metrics are recorded (a
    # hook may add to them) and its checkpoint, but not after the step a stop signal ends the job at (its
    # checkpoint comes first): the one place evaluation and other per-step work plug in (docs/JOBS.md,
    # "Metrics").
    after_step: list[Callable[[Job, int, dict], None]] = dataclasses.field(default_factory=list)
    # Target tokens of this job's applied steps (of all ranks): none at the last step is a failed job.
    trained: int = 0


def run_job(cfg, training: str, device: torch.device, plan: MemoryPlan, run_dir: Path, auto_warmup: bool,
            world: World = World.single(), run_log: RunLog | None = None, overrides: list[str] | None = None) -> dict:
    """The job of a validated `cfg` whose plan fits and whose run directory exists: resume or start, build,
    train, checkpoint; returns the last step's metrics. Rank 0 alone writes the run directory (but for the
    checkpoints, which every rank writes a part of), the metrics and W&B. `run_log`: rank 0's train.log, kept
    once the run may continue the run directory; `overrides`: a sweep job's, kept then too."""
    job = start_job(cfg, training, device, plan, run_dir, auto_warmup, world, run_log, overrides)
    completed = False
    with StopSignals() as stop:     # from the first step to the end summary: a signal finishes the step
        try:
            record = run_steps(job, stop)
            completed = True
        finally:
            finish_job(job, completed)
    return record


def start_job(cfg, training: str, device: torch.device, plan: MemoryPlan, run_dir: Path, auto_warmup: bool,
              world: World, run_log: RunLog | None = None, overrides: list[str] | None = None) -> Job:
    """Choose the checkpoint to resume, build the data, build the model (and check it fits the checkpoint),
    the optimizer, and restore the checkpoint's state; only then, the run accepted, write the run directory
    (train.log, config.yaml, the records): a refused resume leaves it as it was. Nothing after the restore
    draws random numbers, so the RNG streams continue exactly where the checkpoint left them."""
    checkpoints = CheckpointManager.for_run(run_dir, cfg.checkpoint)
    loaded = agreed_checkpoint(cfg, checkpoints, world)
    world.barrier()     # every rank has read it before rank 0 writes anything
    kept_warmup = keep_started_warmup(cfg, loaded) if loaded and auto_warmup else None
    training += f"; {kept_warmup}" if kept_warmup else ""
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    # Before the model: data that cannot train (trains no token, a bad record) stops the job at no cost.
    stream = data_stream(cfg, model_architecture(cfg).vocab_size, world)
    built = build_model(cfg, device, plan, resumed=loaded is not None,
                        sequence_group=world.sequence_group if world.sequence > 1 else None)
    model = built.model
    if loaded:
        check_same_shapes(loaded, model, cfg)
    # Whole, before any sharding; written only when missing (by a new run, whose checks are all passed).
    world.on_main(lambda: keep_random_base(cfg, model, run_dir))
    world.on_main(lambda: keep_extended_base(cfg, model, run_dir))
    if cfg.parallel.shard and world.distributed:
        shard_model(model, world, device)
    # Pinning costs ~0.6 s per GiB: do it now, so the first step's time and the W&B step times are real.
    built.policy.pin_buffers(built.plan.shape)
    evaluator = build_evaluator(cfg, model, device, world)
    optimizer = build_optimizer(model, cfg.optim, built.plan.full_state)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    progress = loaded.progress if loaded else Progress()
    if loaded:      # its last checks: the data state is this data's, the weights fit
        checkpoints.restore(loaded, model, optimizer, scheduler, stream, cfg.resume_force, world)
    world.on_main(lambda: accept_run(run_dir, run_log, config_yaml, overrides))
    world.on_main(lambda: tidy_checkpoints(checkpoints, loaded))
    wandb_run, metrics_log = open_records(cfg, run_dir, progress, loaded is not None, built, device, world)
    peaks = flop_peaks(torch.cuda.get_device_name(device) if device.type == "cuda" else None, cfg.logger.peak_tflops)
    flops = summarize_start(cfg, training, device, built, run_dir, world, loaded, progress, wandb_run, peaks)
    checkpoints.restart_interval(progress.step)
    # The loaded copy of the weights and optimizer state is freed when this returns, before training.
    job = Job(cfg=cfg, world=world, device=device, run_dir=run_dir, model=model, optimizer=optimizer,
              scheduler=scheduler, stream=stream, progress=progress, checkpoints=checkpoints,
              config_yaml=config_yaml, step_flops=flops, flop_peaks=peaks,
              guard=BadStepCounter(cfg.max_bad_steps, progress.skipped_steps),
              bar=ProgressBar(progress.step, cfg.max_steps, cfg.logger.progress_bar and world.is_main),
              metrics_log=metrics_log, wandb_run=wandb_run, last_checkpoint=loaded.path if loaded else None,
              first_step=progress.step)
    if evaluator:
        start_evaluation(job, evaluator, resumed=loaded is not None)
    return job


def start_evaluation(job: Job, evaluator: Evaluator, resumed: bool) -> None:
    """The base model's figures before the first step (eval.at_start; row 0 of metrics.jsonl, not again on a
    resume), then an evaluation after every step that is due, added to that step's metrics."""
    if evaluation := evaluate_at_start(job.cfg, evaluator, resumed=resumed):
        if job.metrics_log:
            job.metrics_log.write(0, evaluation)
            log.info("%s", eval_line(0, evaluation))
        job.bar.restart_clock()

    def evaluate_after(job: Job, step: int, metrics: dict) -> None:
        if evaluation := evaluator.after_step(step):
            metrics.update(evaluation)
            if job.metrics_log:
                job.bar.write(eval_line(step, evaluation))
    job.after_step.append(evaluate_after)


def open_records(cfg, run_dir: Path, progress: Progress, resumed: bool, built: Built, device: torch.device,
                 world: World):
    """Rank 0's W&B run (continuing the checkpoint's, whose id `progress` then keeps) and metrics log, which
    keeps the records up to the resumed step, none for a new run (a row 0 left by one that died before its
    first step is written again); (None, None) on the other ranks."""
    if not world.is_main:
        return None, None
    wandb_run = open_wandb(cfg.logger.wandb, run_dir, OmegaConf.to_container(cfg, resolve=True),
                           progress.wandb_run_id)
    if wandb_run:
        progress.wandb_run_id = wandb_run.id
    metrics_log = MetricsLog(run_dir, progress.step if resumed else -1, wandb_run)
    add_memory_engine_sources(metrics_log, built, device)
    return wandb_run, metrics_log


def summarize_start(cfg, training: str, device: torch.device, built: Built, run_dir: Path, world: World, loaded,
                    progress: Progress, wandb_run, peaks: FlopPeaks) -> float:
    """Show the startup summary; returns the FLOPs of one step (of all ranks), for the MFU."""
    model = built.model
    trainable, total = count_parameters(model)
    sequences = cfg.batch_size * cfg.optim.grad_accum_steps * world.data_parallel
    flops = step_flops(model.config, cfg.train, cfg.seq_len, sequences)
    startup_summary({
        "model": f"{cfg.model.name} ({cfg.model.path or 'random init'}), train.mode={cfg.train.mode}, "
                 f"device={device}, kernels={kernels.get_backend()}{gpu_name(device)}",
        "processes": (f"{world.size} (sequence parallel over {world.sequence}, data parallel over "
                      f"{world.data_parallel}{sharding(model)}); rank 0 writes the run directory"
                      if world.distributed else "1"),
        "training": training,
        "parameters": f"{trainable / 1e6:.2f}M trainable of {total / 1e6:.2f}M",
        "tokens/step": f"seq_len {cfg.seq_len} x {sequences} sequences = {cfg.seq_len * sequences}",
        "MFU": mfu_summary(flops, peaks, device),
        "rope": context_summary(cfg),
        "run dir": str(run_dir),
        "start": (f"resumed from {loaded.path} at step {progress.step}/{cfg.max_steps}" if loaded else
                  f"new run (resume={cfg.resume}; to continue it later: output_dir={run_dir})"),
        "memory plan": planned_memory(built.plan, device),
        "W&B": cfg.logger.wandb.mode + (f", run {progress.wandb_run_id}" if wandb_run else ""),
    })
    return flops


def mfu_summary(flops: float, peaks: FlopPeaks, device: torch.device) -> str:
    """The step's model FLOPs and what its MFU figures divide by (the convention: docs/JOBS.md, "Metrics")."""
    if peaks.datasheet is None:
        why = "on a GPU with a datasheet peak (logger.peak_tflops gives one)" if device.type == "cuda" else "on a GPU"
        return f"{flops:.3g} FLOPs a step; MFU only {why}"
    measured = "" if peaks.measured is None else f", mfu_measured_ceiling over the measured {peaks.measured:.0f}"
    return f"{flops:.3g} FLOPs a step; mfu over the peak {peaks.datasheet:.0f} TFLOP/s{measured}"


def run_steps(job: Job, stop: StopSignals) -> dict:
    """Train from the job's step to max_steps, or until a stop signal (then checkpoint and return); returns
    the last step's record (rank 0; the others return the starting step), with `stopped_by`, the signal's
    number, when one stopped it."""
    record = {"step": job.progress.step}
    for step in range(job.progress.step + 1, job.cfg.max_steps + 1):
        applied, metrics = run_step(job, step)
        # Decided together, read once: a signal to any rank stops all after this same step, its checkpoint
        # before any hook's work; one arriving later is served after the next step.
        stopping, due = job.world.any([stop.requested, job.checkpoints.due(step)])
        if not stopping:
            for hook in job.after_step:
                hook(job, step, metrics)
        if job.metrics_log:
            record = record_step(job, step, applied, metrics)
        if job.guard.exhausted:
            job.guard.stop(step, last_good_checkpoint(job))
        if checkpoint_after(job, step, applied, stopping, due):
            # Every rank exits with the same status, that of the signal (of the highest number) received.
            return record | {"stopped_by": int(job.world.max({"signal": stop.received or 0})["signal"])}
    return record


def last_good_checkpoint(job: Job) -> Path | None:
    """The newest checkpoint of the job whose files still match their checksums, checked by rank 0 alone."""
    world = job.world
    return world.main_value(job.checkpoints.last_good(job.last_checkpoint) if world.is_main else None)


def run_step(job: Job, step: int) -> tuple[bool, dict]:
    """One training step on every rank: its micro-batches, the update, the guard's count, the progress;
    returns whether the update was applied and the step's metrics (memory: the highest rank's)."""
    cfg, world, device = job.cfg, job.world, job.device
    started = time.perf_counter()
    micro_batches = next_micro_batches(job.stream, cfg.optim.grad_accum_steps, world)
    data_wait = time.perf_counter() - started
    lr = job.scheduler.get_last_lr()[0]
    reset_peak_memory(device)
    result = train_step(job.model, micro_batches, job.optimizer, job.scheduler, cfg.optim.grad_clip, device, world)
    wait_for_device(device)
    step_time = time.perf_counter() - started
    job.guard.record(result.applied)
    job.trained += result.supervised if result.applied else 0
    progress = job.progress
    progress.step, progress.tokens_seen = step, progress.tokens_seen + result.tokens
    progress.skipped_steps = job.guard.skipped
    return result.applied, {
        "loss": result.loss, "accuracy": result.accuracy, "lr": lr, "grad_norm": result.grad_norm,
        "applied": result.applied, "tokens_seen": progress.tokens_seen,
        "skipped_steps": job.guard.skipped, "tokens_per_s": result.tokens / step_time,
        **mfu_metrics(job.step_flops / world.size, step_time, job.flop_peaks),
        "step_time_s": step_time, "data_wait_s": data_wait, **world.max(memory_metrics(device))}


def record_step(job: Job, step: int, applied: bool, metrics: dict) -> dict:
    """On rank 0: write the step's metrics (metrics.jsonl, W&B), move the bar and log every log_every steps;
    returns the record written."""
    record = job.metrics_log.write(step, metrics)
    job.bar.update(record)
    if step % job.cfg.log_every == 0 or step == job.cfg.max_steps or not applied:
        job.bar.write(job.bar.step_line(record))
    return record


def checkpoint_after(job: Job, step: int, applied: bool, stopping: bool, due: bool) -> bool:
    """Checkpoint after `step` when the job is `stopping` (a signal), at the last step, or when one is `due`
    after a good step; returns whether the job stops here. After the last step's checkpoint, a job that trained
    no token fails (check_trained)."""
    # A skipped step left the weights untouched, so saving after it is safe; periodic saves still wait for a
    # good step, so "the last checkpoint" is never taken mid-divergence.
    if stopping or step == job.cfg.max_steps or (applied and due):
        saving = time.perf_counter()
        job.last_checkpoint = job.checkpoints.save(job.model, job.optimizer, job.scheduler, job.stream, job.progress,
                                                   job.config_yaml, job.world)
        job.bar.write(f"checkpoint {job.last_checkpoint} written in {time.perf_counter() - saving:.1f}s")
    if step == job.cfg.max_steps:
        check_trained(job)
    if stopping:
        job.bar.write(f"stopped by signal after step {step}; continue with output_dir={job.run_dir}")
    return stopping


def check_trained(job: Job) -> None:
    """DataError when the job ran its steps to max_steps without training one target token (each step read
    none, a loss of 0, or was skipped for a NaN/Inf loss): nothing was learned, so it must not exit 0."""
    ran = job.progress.step - job.first_step
    if ran and not job.trained:
        raise DataError(f"no step of this run trained a token: each of its {ran} steps read no target (loss 0) or "
                        f"was skipped (loss or gradients NaN/Inf), so nothing was learned: check data.*, seq_len="
                        f"{job.cfg.seq_len} and model.rope_* (docs/DATA.md); {job.last_checkpoint} holds what the "
                        f"steps did")


def finish_job(job: Job, completed: bool) -> None:
    """Close the bar and the W&B run (exit code 0 when the steps `completed`, 1 after an error), then, when
    completed, rank 0 shows the end summary. The model lets go of the sequence-parallel group first, before
    train() closes the world (trainer.build.release_sequence_group says why)."""
    release_sequence_group(job.model)
    job.bar.close()
    if job.wandb_run:
        finish_wandb(job.wandb_run, completed)
    if completed and job.world.is_main:
        end_summary(job.run_dir, job.first_step, job.cfg.max_steps, job.last_checkpoint)


def finish_wandb(wandb_run, completed: bool) -> None:
    """Close the W&B run. After the job's error its own failures (its log files on a full disk, most likely the
    job's error too) are not shown over that error: no traceback for each line it cannot log, one line if it
    cannot close."""
    if completed:
        wandb_run.finish(0)
        return
    raising, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        wandb_run.finish(1)
    except Exception as error:
        if not disk_is_full(error):     # a full disk: the job's own line says it
            log.warning("the W&B run could not be closed after the job's error: %s", error)
    finally:
        logging.raiseExceptions = raising


def agreed_capacity(cfg, device: torch.device, world: World) -> Capacity:
    """This rank's share of its machine's memory, lowered to the smallest share of any rank: every rank must
    make the same plan, as a layer recomputed on one rank and not on another would exchange its attention
    (sequence parallelism) in a collective the other never joins."""
    mine = Capacity.detect(device, cfg.memory).shared_by(ranks_per_host())
    smallest = world.min({"gpu": mine.gpu, "host": mine.host, "pinnable": mine.pinnable})
    return dataclasses.replace(mine, **{name: int(value) for name, value in smallest.items()})


def data_stream(cfg, vocab_size: int, world: World):
    """The batch stream; over several processes the first rank of each machine builds it first (tokenizing
    files into the datasets cache) and the others then read that cache instead of tokenizing again."""
    def build():
        return build_data(cfg.data, cfg.seq_len, cfg.batch_size, cfg.seed, vocab_size, tokenizer_path=cfg.model.path,
                          trained_context=trained_context(cfg), held_out=cfg.eval.fraction)
    first = local_rank() == 0
    stream = build() if first else None
    world.barrier()
    return stream if first else build()


def next_micro_batches(stream, accumulation: int, world: World) -> list:
    """This rank's micro-batches of the next step. Every rank reads the same stream, and the step's
    accumulation x data-parallel batches are dealt out by sequence-parallel group, so the data of a step
    does not depend on which rank reads it and the stream's state is the same on every rank (one is saved)."""
    batches = [next(stream) for _ in range(accumulation * world.data_parallel)]
    return batches[world.data_rank::world.data_parallel]
