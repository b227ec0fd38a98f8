"""Evaluation: held-out loss and perplexity, loss by token position, and passkey retrieval, during training
(every eval.every_steps steps; `Evaluator.after_step`) and by scripts/evaluate.py.

Forward only, under no_grad with the model in eval mode: the memory policy keeps nothing (it checkpoints only
under grad), and the loss is the chunked linear cross-entropy, so no logits tensor exists; an evaluation
fits wherever a training step does (offload.plan counts its peak, `MemoryPlan.eval_peak`). Nothing here
draws random numbers or touches the training data stream, so training is the same with evaluation on or off.

Figures (metrics.jsonl and W&B, keys under eval/): loss, perplexity, tokens, accuracy (where the supervised
tokens are few enough for their logits: the recall task), loss_pos/<from>-<to> (the mean loss of the next
token at positions [from, to) of their documents: powers of two up to seq_len), and with a tokenizer
passkey/accuracy, passkey/<length> (over depths) and passkey/<length>/<depth %> per cell. Over several
processes each rank evaluates its share (its slice of its data-parallel group's batches) and the sums are
combined before any figure is taken.
"""
from __future__ import annotations

import logging
import math
import time

import torch

import kernels
from conf.schema.eval import evaluating, starts_with_eval
from data import IGNORE_INDEX, Batch
from data.held_out import held_out_data
from data.passkey import PasskeyGrid, passkey_grid, passkey_lengths
from data.tokenize import check_tokenizer_files, load_tokenizer
from model import unwrap_model
from offload.units import GIB
from trainer.distributed import World, local_rank
from trainer.metrics import reset_peak_memory, wait_for_device
from trainer.step import autocast, supervised_correct

log = logging.getLogger(__name__)

# Positions below this form the first bucket; above it each bucket doubles.
FIRST_BUCKET = 64


def position_edges(seq_len: int) -> list[int]:
    """Bucket edges: 0, 64, 128, ... (powers of two) and seq_len."""
    edges, edge = [0], FIRST_BUCKET
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [seq_len]


def bucket_names(edges: list[int]) -> list[str]:
    return [f"eval/loss_pos/{low}-{high}" for low, high in zip(edges, edges[1:])]


def bucket_losses(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                  edges: list[int]) -> tuple[list[float], list[int]]:
    """(summed loss, supervised tokens) per position bucket of one batch. Each bucket's tokens go through
    the fused linear cross-entropy once (the buckets partition the tokens: one pass over all of them)."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    bucket = torch.bucketize(positions.reshape(-1).to(labels.device), torch.tensor(edges[1:-1], device=labels.device),
                             right=True)
    supervised = labels != IGNORE_INDEX
    sums, counts = [], []
    for index in range(len(edges) - 1):
        chosen = supervised & (bucket == index)
        count = int(chosen.sum())
        loss = kernels.linear_cross_entropy(hidden[chosen], head, labels[chosen], reduction="sum") if count else 0.0
        sums.append(float(loss))
        counts.append(count)
    return sums, counts


def answer_misses(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, cells: torch.Tensor,
                  cell_count: int) -> tuple[list[int], list[int]]:
    """(wrong greedy tokens, answer tokens) per passkey cell: the logits only of the answer positions, in the
    head's dtype (an fp32 copy of an 8B model's head would be 2 GiB that MemoryPlan.eval_peak does not count)."""
    chosen = cells.reshape(-1).to(labels.device) >= 0
    flat_cells = cells.reshape(-1).to(labels.device)[chosen]
    logits = (hidden.reshape(-1, hidden.shape[-1])[chosen].to(head.dtype) @ head.t()).float()
    wrong = (logits.argmax(-1) != labels.reshape(-1)[chosen]).long()
    return (torch.bincount(flat_cells, wrong, minlength=cell_count).long().tolist(),
            torch.bincount(flat_cells, minlength=cell_count).tolist())


class Evaluator:
    """Evaluates `model` on fixed held-out batches (and a passkey grid) when due, on every rank of `world`."""

    def __init__(self, model: torch.nn.Module, device: torch.device, world: World, seq_len: int,
                 held_out: list[Batch], passkey: PasskeyGrid | None, every_steps: int = 0,
                 passkey_every_steps: int = 0, max_steps: int = 0):
        self.model, self.device, self.world = model, device, world
        self.edges = position_edges(seq_len)
        self.held_out, self.passkey = held_out, passkey
        self.every_steps, self.passkey_every_steps, self.max_steps = every_steps, passkey_every_steps, max_steps

    def passkey_due(self, step: int) -> bool:
        if self.passkey is None:
            return False
        return step == self.max_steps or (self.passkey_every_steps > 0 and step % self.passkey_every_steps == 0)

    def due(self, step: int) -> bool:
        """Every eval.every_steps steps, when the passkey is, and at the last step (the trainer builds an
        Evaluator only when some evaluation is on, conf.schema.eval.evaluating)."""
        regular = self.every_steps > 0 and step % self.every_steps == 0
        return regular or step == self.max_steps or self.passkey_due(step)

    def after_step(self, step: int) -> dict:
        """The figures of `step` when an evaluation is due then, else {}. Every rank calls it."""
        return self.evaluate(self.passkey_due(step)) if self.due(step) else {}

    def evaluate(self, with_passkey: bool = True) -> dict:
        """Every figure: the held-out ones, and the passkey's when `with_passkey` and there is a grid."""
        started = time.perf_counter()
        reset_peak_memory(self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                sums = self._held_out_sums()
                passkey = self._passkey_sums() if with_passkey and self.passkey is not None else []
        finally:
            self.model.train(was_training)
        wait_for_device(self.device)
        totals = self.world.sum(sums + passkey)
        figures = self._held_out_figures(totals[:len(sums)])
        if passkey:
            figures |= self._passkey_figures(totals[len(sums):])
        figures["eval/time_s"] = time.perf_counter() - started
        if self.device.type == "cuda":
            figures["eval/gpu_peak_gib"] = self.world.max({"peak": torch.cuda.max_memory_allocated(self.device)})[
                "peak"] / GIB
        return figures

    def _mine(self, count: int) -> range:
        """Which of `count` batches this rank's data-parallel group evaluates."""
        return range(self.world.data_rank, count, self.world.data_parallel)

    def _hidden(self, batch: Batch) -> tuple[Batch, torch.Tensor]:
        batch = batch.to(self.device)
        with autocast(self.device):
            return batch, self.model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)

    def _held_out_sums(self) -> list[float]:
        """Per bucket summed loss, then per bucket tokens, then the accuracy's correct and counted tokens and
        its unmeasurable batches (trainer.step.supervised_correct)."""
        buckets = len(self.edges) - 1
        losses, counts = [0.0] * buckets, [0] * buckets
        correct = counted = unmeasurable = 0
        head = unwrap_model(self.model).lm_head.weight
        for index in self._mine(len(self.held_out)):
            shard = self.held_out[index].shard(self.world.sequence_rank, self.world.sequence)
            batch, hidden = self._hidden(shard)
            with autocast(self.device):
                batch_losses, batch_counts = bucket_losses(hidden, head, batch.labels, batch.position_ids,
                                                           self.edges)
            losses = [total + part for total, part in zip(losses, batch_losses)]
            counts = [total + part for total, part in zip(counts, batch_counts)]
            tally = supervised_correct(self.model, hidden, batch.labels)
            if tally is None:
                unmeasurable += 1
            else:
                correct, counted = correct + tally[0], counted + tally[1]
            del hidden
        return losses + counts + [correct, counted, unmeasurable]

    def _held_out_figures(self, totals: list[float]) -> dict:
        buckets = len(self.edges) - 1
        losses, counts, (correct, counted, unmeasurable) = totals[:buckets], totals[buckets:2 * buckets], totals[-3:]
        tokens = sum(counts)
        loss = sum(losses) / tokens if tokens else float("nan")
        figures = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": int(tokens)}
        figures |= {name: total / count for name, total, count in zip(bucket_names(self.edges), losses, counts)
                    if count}
        if counted and not unmeasurable:
            figures["eval/accuracy"] = correct / counted
        return figures

    def _passkey_sums(self) -> list[float]:
        """Per cell wrong greedy answer tokens, then per cell answer tokens."""
        grid, cells = self.passkey, self.passkey.cell_count
        wrong, total = [0] * cells, [0] * cells
        head = unwrap_model(self.model).lm_head.weight
        for index in self._mine(len(grid.batches)):
            shard, shard_cells = grid.shard(index, self.world.sequence_rank, self.world.sequence)
            batch, hidden = self._hidden(shard)
            batch_wrong, batch_total = answer_misses(hidden, head, batch.labels, shard_cells, cells)
            wrong = [sum_ + part for sum_, part in zip(wrong, batch_wrong)]
            total = [sum_ + part for sum_, part in zip(total, batch_total)]
            del hidden
        return wrong + total

    def _passkey_figures(self, totals: list[float]) -> dict:
        """Exact match per cell (every answer token right), averaged over trials and over the depths whose keys
        were placed at the same whole percent (named by that depth placed, PasskeyGrid.placed, not the depth
        asked for: they differ in short haystacks), then over depths and lengths."""
        grid = self.passkey
        cells, per_length_cells = grid.cell_count, len(grid.depths) * grid.trials
        exact = [wrong == 0 and count > 0 for wrong, count in zip(totals[:cells], totals[cells:])]
        figures, per_length = {}, []
        for li, length in enumerate(grid.lengths):
            by_depth: dict[int, list[bool]] = {}
            for di in range(len(grid.depths)):
                first = (li * len(grid.depths) + di) * grid.trials
                trials = range(first, first + grid.trials)
                placed = round(100 * sum(grid.placed[cell] for cell in trials) / grid.trials)
                by_depth.setdefault(placed, []).extend(exact[cell] for cell in trials)
            figures |= {f"eval/passkey/{length}/{placed}": sum(hits) / len(hits) for placed, hits in by_depth.items()}
            of_length = exact[li * per_length_cells:(li + 1) * per_length_cells]
            figures[f"eval/passkey/{length}"] = sum(of_length) / len(of_length)
            per_length.append(figures[f"eval/passkey/{length}"])
        figures["eval/passkey/accuracy"] = sum(per_length) / len(per_length)
        return figures


def eval_line(step: int, figures: dict) -> str:
    """The console's line for an evaluation."""
    parts = [f"eval at step {step}: loss {figures['eval/loss']:.4f} ppl {figures['eval/perplexity']:.2f}"]
    if "eval/accuracy" in figures:
        parts.append(f"acc {figures['eval/accuracy']:.3f}")
    if "eval/passkey/accuracy" in figures:
        parts.append(f"passkey {figures['eval/passkey/accuracy']:.2f}")
    far = [name for name in figures if name.startswith("eval/loss_pos/")]
    if far:
        parts.append(f"loss at positions {far[-1].rpartition('/')[2]} {figures[far[-1]]:.4f}")
    return ", ".join(parts) + f" ({figures['eval/time_s']:.1f}s)"


def build_evaluator(cfg, model: torch.nn.Module, device: torch.device,
                    world: World = World.single()) -> Evaluator | None:
    """The run's Evaluator, or None when cfg.eval turns evaluation off. Over several processes the first rank
    of each machine reads (and tokenizes into the cache) first, then the others read the cache."""
    if not evaluating(cfg.eval):
        return None
    first = local_rank() == 0
    evaluator = evaluator_for(cfg, model, device, world) if first else None
    world.barrier()
    return evaluator if first else evaluator_for(cfg, model, device, world)


def evaluator_for(cfg, model: torch.nn.Module, device: torch.device, world: World) -> Evaluator:
    """The held-out batches (eval.sequences, rounded up to whole batches for each data-parallel group) and,
    where model.path has a tokenizer, the passkey grid."""
    batches = -(-cfg.eval.sequences // cfg.batch_size)
    batches += -batches % world.data_parallel
    vocab_size = unwrap_model(model).config.vocab_size
    held = held_out_data(cfg.data, cfg.eval.path, cfg.eval.fraction, cfg.seq_len, cfg.batch_size, cfg.seed,
                         vocab_size, cfg.model.path, batches)
    passkey = passkey_for(cfg, held.text, world)
    log.info("evaluation: %d held-out batches of %d x %d tokens%s", len(held.batches), cfg.batch_size, cfg.seq_len,
             f", passkey {len(passkey.lengths)} lengths x {len(passkey.depths)} depths x {passkey.trials} in "
             f"{len(passkey.batches)} batches" if passkey else ", no passkey probe")
    return Evaluator(model, device, world, cfg.seq_len, held.batches, passkey, cfg.eval.every_steps,
                     cfg.eval.passkey.every_steps, cfg.max_steps)


def passkey_tokenizer(cfg):
    """model.path's tokenizer for the passkey probe; None when there is no probe: evaluation off,
    eval.passkey.lengths=0, or no tokenizer (the recall task's held-out accuracy stands in)."""
    if not evaluating(cfg.eval) or cfg.eval.passkey.lengths == 0 or not cfg.model.path:
        return None
    try:
        check_tokenizer_files(cfg.model.path)
    except ValueError:
        return None
    return load_tokenizer(cfg.model.path)


def check_passkey(cfg) -> None:
    """Before anything is built: the probe's haystack lengths (given, or derived from seq_len) against the
    shortest haystack model.path's tokenizer allows (DataError naming eval.passkey.lengths and the fix)."""
    tokenizer = passkey_tokenizer(cfg)
    if tokenizer is not None:
        settings = cfg.eval.passkey
        passkey_lengths(tokenizer, cfg.seq_len, settings.lengths, settings.depths, settings.trials)


def passkey_for(cfg, held_out_text: list[int] | None, world: World) -> PasskeyGrid | None:
    """The passkey grid with model.path's tokenizer; None without a probe (passkey_tokenizer) or when no
    haystack length derived from seq_len fits this tokenizer (logged)."""
    settings = cfg.eval.passkey
    tokenizer = passkey_tokenizer(cfg)
    if tokenizer is None:
        if settings.lengths != 0 and cfg.model.path:
            log.info("eval: no passkey probe (model.path has no tokenizer)")
        return None
    if not passkey_lengths(tokenizer, cfg.seq_len, settings.lengths, settings.depths, settings.trials):
        log.info("eval: no passkey probe: seq_len=%d is shorter than the shortest haystack this tokenizer allows",
                 cfg.seq_len)
        return None
    filler = None if settings.filler == "builtin" else held_out_text
    return passkey_grid(tokenizer, cfg.seq_len, cfg.batch_size, settings.lengths, settings.depths, settings.trials,
                        filler, world.data_parallel)


def evaluate_at_start(cfg, evaluator: Evaluator | None, resumed: bool) -> dict:
    """The figures of a new run before its first step (eval.at_start), else {}."""
    if evaluator is None or resumed or not starts_with_eval(cfg.eval):
        return {}
    return evaluator.evaluate(with_passkey=True)
