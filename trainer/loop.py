"""The training loop: config in, trained model and a run directory out.

Run directory (output_dir): config.yaml, train.log, metrics.jsonl, checkpoints/step-<N>/, wandb/, and for
LoRA on a random init base_model/. The parts that make a long job trustworthy live in small modules:
trainer.checkpoint_manager (crash-safe checkpoints), trainer.resume (which one to continue from),
trainer.signals (SIGTERM/SIGINT), trainer.guard (NaN/Inf steps), trainer.metrics, trainer.wandb_run and
trainer.console (what is recorded and shown).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

import kernels
from conf.schema.job import resolve_device
from conf.validate import ConfigError, validate
from data import build_data, preflight_data
from model.hf_checkpoint import full_weights, is_lora
from offload.byte_model import Capacity
from offload.plan import MemoryPlan
from offload.units import GIB
from trainer.allocator import cap_gpu_memory, gpu_cap_note
from trainer.build import (Built, build_model, checked_plan, context_summary, count_parameters, keep_extended_base,
                           record_architecture, trained_context)
from trainer.checkpoint_format import BASE_MODEL_DIR, Progress
from trainer.checkpoint_manager import CheckpointManager
from trainer.console import ProgressBar, end_summary, logging_to_run_dir, quiet_rank, startup_summary
from trainer.disk_space import save_hf_model_if_room
from trainer.distributed import World, close_world, init_world, local_rank, rank_device, ranks_per_host
from trainer.evaluate import build_evaluator, eval_line, evaluate_at_start
from trainer.guard import BadStepCounter
from trainer.metrics import (MetricsLog, memory_metrics, model_flops_utilization, reset_peak_memory, step_flops,
                             wait_for_device)
from trainer.optim import build_optimizer, build_scheduler
from trainer.resume import checkpoint_to_resume, keep_started_warmup
from trainer.sharding import shard_model, sharding
from trainer.signals import StopSignals
from trainer.step import train_step
from trainer.wandb_run import open_wandb

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def create_run_dir(run_dir: Path) -> None:
    """The first write of a run, after validation: output_dir."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"output_dir={str(run_dir)!r} cannot be created: {error.strerror}") from None


def keep_random_base(cfg, model: torch.nn.Module, run_dir: Path) -> None:
    """A LoRA adapter is only usable with its base: keep a random-init base once, for scripts/export.py."""
    base_dir = run_dir / BASE_MODEL_DIR
    if is_lora(model) and not cfg.model.path and cfg.checkpoint.save_random_base and not base_dir.is_dir():
        save_hf_model_if_room(full_weights(model), model.config.to_hf_dict(), base_dir)


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


def train(cfg) -> dict:
    """Train to cfg.max_steps, or until SIGTERM/SIGINT (then checkpoint and return); returns the last
    step's metrics. Under torchrun every process runs this, as one rank of the job (trainer.distributed)."""
    auto_warmup = cfg.optim.warmup_steps is None
    training = validate(cfg)
    record_architecture(cfg)
    preflight_data(cfg.data, cfg.model.path)
    device = rank_device(resolve_device(cfg.device))
    world = init_world(cfg.parallel.sequence, device)
    try:
        kernels.set_backend(cfg.kernels, deterministic=cfg.deterministic)
        kernels.set_sequence_parallel(world.sequence_group if world.sequence > 1 else None)
        seed_everything(cfg.seed)
        # A job that cannot fit stops before writing anything.
        plan = checked_plan(cfg, device, capacity=agreed_capacity(cfg, device, world))
        cap_gpu_memory(plan.capacity.gpu, device)      # a plan for a smaller GPU than this one: hold it to that
        # One run directory for all ranks: the default output_dir is resolved from each process's clock.
        cfg.output_dir = world.main_value(str(cfg.output_dir))
        run_dir = Path(cfg.output_dir)
        world.on_main(lambda: create_run_dir(run_dir))
        with logging_to_run_dir(run_dir) if world.is_main else quiet_rank(world.rank):
            return run_job(cfg, training, device, plan, run_dir, auto_warmup, world)
    finally:
        kernels.set_sequence_parallel(None)
        close_world(world)


def run_job(cfg, training: str, device: torch.device, plan: MemoryPlan, run_dir: Path, auto_warmup: bool,
            world: World = World.single()) -> dict:
    """The job of a validated `cfg` whose plan fits and whose run directory exists: resume or start, build,
    train, checkpoint; returns the last step's metrics. Rank 0 alone writes the run directory (but for the
    checkpoints, which every rank writes a part of), the metrics and W&B."""
    checkpoints = CheckpointManager.for_run(run_dir, cfg.checkpoint)
    loaded = checkpoint_to_resume(cfg, checkpoints, world.is_main)
    world.barrier()     # every rank has chosen before rank 0 writes anything a choice looks at
    kept_warmup = keep_started_warmup(cfg, loaded) if loaded and auto_warmup else None
    training += f"; {kept_warmup}" if kept_warmup else ""
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    world.on_main(lambda: (run_dir / "config.yaml").write_text(config_yaml))

    built = build_model(cfg, device, plan, resumed=loaded is not None)
    model = built.model
    world.on_main(lambda: keep_random_base(cfg, model, run_dir))     # whole, before any sharding
    world.on_main(lambda: keep_extended_base(cfg, model, run_dir))
    if cfg.parallel.shard and world.distributed:
        shard_model(model, world, device)
    # Pinning costs ~0.6 s per GiB: do it now, so the first step's time and the W&B step times are real.
    built.policy.pin_buffers(built.plan.shape)
    stream = data_stream(cfg, model.config.vocab_size, world)
    evaluator = build_evaluator(cfg, model, device, world)
    optimizer = build_optimizer(model, cfg.optim, built.plan.full_state)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)
    progress = loaded.progress if loaded else Progress()
    wandb_run = None
    if world.is_main:
        wandb_run = open_wandb(cfg.logger.wandb, run_dir, OmegaConf.to_container(cfg, resolve=True),
                               progress.wandb_run_id)
    if wandb_run:
        progress.wandb_run_id = wandb_run.id
    metrics_log = MetricsLog(run_dir, progress.step, wandb_run) if world.is_main else None
    if metrics_log:
        add_memory_engine_sources(metrics_log, built, device)

    trainable, total = count_parameters(model)
    sequences = cfg.batch_size * cfg.optim.grad_accum_steps * world.data_parallel
    flops = step_flops(total, model.config.num_hidden_layers, model.config.hidden_size, cfg.seq_len, sequences)
    startup_summary({
        "model": f"{cfg.model.name} ({cfg.model.path or 'random init'}), train.mode={cfg.train.mode}, "
                 f"device={device}, kernels={kernels.get_backend()}{gpu_name(device)}",
        "processes": (f"{world.size} (sequence parallel over {world.sequence}, data parallel over "
                      f"{world.data_parallel}{sharding(model)}); rank 0 writes the run directory"
                      if world.distributed else "1"),
        "training": training,
        "parameters": f"{trainable / 1e6:.2f}M trainable of {total / 1e6:.2f}M",
        "tokens/step": f"seq_len {cfg.seq_len} x {sequences} sequences = {cfg.seq_len * sequences}",
        "rope": context_summary(cfg),
        "run dir": str(run_dir),
        "start": (f"resumed from {loaded.path} at step {progress.step}/{cfg.max_steps}" if loaded else
                  f"new run (resume={cfg.resume}; to continue it later: output_dir={run_dir})"),
        "memory plan": planned_memory(built.plan, device),
        "W&B": cfg.logger.wandb.mode + (f", run {progress.wandb_run_id}" if wandb_run else ""),
    })
    if loaded:
        # Last, so the RNG streams continue exactly where the checkpoint left them.
        checkpoints.restore(loaded, model, optimizer, scheduler, stream, cfg.resume_force, world)

    if evaluation := evaluate_at_start(cfg, evaluator, resumed=loaded is not None):
        if metrics_log:
            metrics_log.write(0, evaluation)
            log.info("%s", eval_line(0, evaluation))
    guard = BadStepCounter(cfg.max_bad_steps, progress.skipped_steps)
    checkpoints.restart_interval(progress.step)
    last_checkpoint = loaded.path if loaded else None
    del loaded      # applied: free its copy of the weights and optimizer state before training
    first_step = progress.step
    bar = ProgressBar(first_step, cfg.max_steps, cfg.logger.progress_bar and world.is_main)
    record, exit_code = {"step": progress.step}, 1
    try:
        with StopSignals() as stop:
            for step in range(progress.step + 1, cfg.max_steps + 1):
                started = time.perf_counter()
                micro_batches = next_micro_batches(stream, cfg.optim.grad_accum_steps, world)
                data_wait = time.perf_counter() - started
                lr = scheduler.get_last_lr()[0]
                reset_peak_memory(device)
                result = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, device, world)
                wait_for_device(device)
                step_time = time.perf_counter() - started
                guard.record(result.applied)
                progress.step, progress.tokens_seen = step, progress.tokens_seen + result.tokens
                progress.skipped_steps = guard.skipped
                # Every rank takes part in the reductions; rank 0 records. Memory is the highest rank's.
                metrics = {
                    "loss": result.loss, "accuracy": result.accuracy, "lr": lr, "grad_norm": result.grad_norm,
                    "applied": result.applied, "tokens_seen": progress.tokens_seen,
                    "skipped_steps": guard.skipped, "tokens_per_s": result.tokens / step_time,
                    "mfu": model_flops_utilization(flops / world.size, step_time, device, cfg.logger.peak_tflops),
                    "step_time_s": step_time, "data_wait_s": data_wait, **world.max(memory_metrics(device))}
                evaluation = evaluator.after_step(step) if evaluator else {}
                if metrics_log:
                    record = metrics_log.write(step, metrics | evaluation)
                    if evaluation:
                        bar.write(eval_line(step, evaluation))
                    bar.update(record)
                    if step % cfg.log_every == 0 or step == cfg.max_steps or not result.applied:
                        bar.write(bar.step_line(record))
                guard.stop_if_exhausted(step, last_checkpoint)
                # Decided together, read once: a signal to any rank stops all after this same step; one
                # arriving later is served after the next step.
                stopping, due = world.any([stop.requested, checkpoints.due(step)])
                # A skipped step left the weights untouched, so saving after it is safe; periodic saves
                # still wait for a good step, so "the last checkpoint" is never taken mid-divergence.
                if stopping or step == cfg.max_steps or (result.applied and due):
                    saving = time.perf_counter()
                    last_checkpoint = checkpoints.save(model, optimizer, scheduler, stream, progress, config_yaml,
                                                       world)
                    bar.write(f"checkpoint {last_checkpoint} written in {time.perf_counter() - saving:.1f}s")
                if stopping:
                    bar.write(f"stopped by signal after step {step}; continue with output_dir={run_dir}")
                    break
        exit_code = 0
    finally:
        bar.close()
        if wandb_run:
            wandb_run.finish(exit_code)
    if world.is_main:
        end_summary(run_dir, first_step, cfg.max_steps, last_checkpoint)
    return record


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
