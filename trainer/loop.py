"""The training loop: config in, trained model and a run directory out."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

import kernels
from conf.validate import resolve_device, validate
from data import build_data
from trainer.build import build_model, count_parameters
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import train_step

log = logging.getLogger(__name__)


def write_resolved_config(cfg, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def train(cfg) -> dict:
    """Train for cfg.max_steps steps; returns the last step's metrics."""
    validate(cfg)
    device = resolve_device(cfg.device)
    kernels.set_backend(cfg.kernels)
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.output_dir)
    write_resolved_config(cfg, run_dir)

    model = build_model(cfg, device)
    trainable, total = count_parameters(model)
    log.info("model %s: %.2fM trainable of %.2fM parameters, seq_len=%d, device=%s, run dir %s",
             cfg.model.name, trainable / 1e6, total / 1e6, cfg.seq_len, device, run_dir)
    stream = build_data(cfg.data, cfg.seq_len, cfg.batch_size, cfg.seed, model.config.vocab_size,
                        tokenizer_path=cfg.model.path)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.max_steps)

    metrics: dict = {}
    window_start, window_tokens = time.perf_counter(), 0
    for step in range(1, cfg.max_steps + 1):
        micro_batches = [next(stream) for _ in range(cfg.optim.grad_accum_steps)]
        result = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, device)
        window_tokens += result.tokens
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            elapsed = time.perf_counter() - window_start
            metrics = {"step": step, "loss": result.loss, "accuracy": result.accuracy,
                       "lr": scheduler.get_last_lr()[0], "grad_norm": result.grad_norm,
                       "tokens_per_s": window_tokens / elapsed}
            accuracy = "" if result.accuracy is None else f" acc {result.accuracy:.3f}"
            log.info("step %d/%d loss %.4f%s lr %.2e grad_norm %.3f tok/s %.0f", step, cfg.max_steps,
                     result.loss, accuracy, metrics["lr"], result.grad_norm, metrics["tokens_per_s"])
            window_start, window_tokens = time.perf_counter(), 0
    return metrics
