"""The `eval` config group: evaluation during training (held-out loss and perplexity, loss by token
position, passkey retrieval) and by scripts/evaluate.py, with its checks.

Held-out data is one of: `eval.path` (files read like data.path, with the data group's options and the
run's tokenizer), a fraction of the training documents split off by document (`eval.fraction`), or for
the synthetic recall task its sequences drawn from another seed (nothing to set). The evaluation runs on
sequences of the training seq_len and packing, forward only (docs/LONG_CONTEXT.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from conf.errors import ConfigError
from conf.schema.parallel import world_size

PASSKEY_FILLERS = ("auto", "held_out", "builtin")


@dataclass
class PasskeyConfig:
    """Passkey retrieval: a random key hidden at several depths of haystacks of several lengths, asked for
    at the end; needs the run's tokenizer (model.path). lengths=0 turns it off."""
    # Haystack lengths: seq_len, seq_len/2, ... (this many, halving); None: those of them (at most 4) at least
    # as long as the shortest haystack the tokenizer allows (its instruction, key and question, and 32 tokens
    # of filler), so the default runs at any seq_len. A number given is checked against that before
    # anything is built.
    lengths: Optional[int] = None
    # Depths of the key, evenly from 0% (start) to 100% (just before the question).
    depths: int = 5
    # Haystacks per (length, depth), each with its own key.
    trials: int = 1
    # 0: at the start and at the end of training only (when evaluation is on); N: also every N steps, with
    # the held-out figures (this alone turns evaluation on). A probe costs about
    # depths x trials x (2 - 2^(1-lengths)) sequences of seq_len.
    every_steps: int = 0
    # The haystack's text: held_out (the held-out documents), builtin (a fixed English filler), or auto
    # (held-out text when the held-out data is text, else builtin).
    filler: str = "auto"


@dataclass
class EvalConfig:
    # Evaluate every N steps; 0: none but eval.passkey.every_steps's and eval.at_start's. Whenever any
    # evaluation is on, a new run also evaluates before its first step (unless at_start=false) and at its last.
    every_steps: int = 0
    # Held-out sequences per evaluation (rounded up to whole batches for each data-parallel group); each costs
    # a forward pass, about a third of a training step's time.
    sequences: int = 2
    # Evaluate before the first step of a new run (the base model at the new length); None: whenever
    # evaluation is on.
    at_start: Optional[bool] = None
    # Held-out files (a file, folder, glob or save_to_disk directory), read with the data.* options.
    path: Optional[str] = None
    # Or: this fraction of the training documents, chosen by document (never by row) with a fixed seed,
    # is held out of training.
    fraction: float = 0.0
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)


def evaluating(eval_cfg) -> bool:
    """Whether the trainer evaluates at all."""
    return eval_cfg.every_steps > 0 or eval_cfg.passkey.every_steps > 0 or bool(eval_cfg.at_start)


def starts_with_eval(eval_cfg) -> bool:
    """Whether a new run evaluates before its first step."""
    return eval_cfg.at_start if eval_cfg.at_start is not None else evaluating(eval_cfg)


def check_eval(cfg) -> None:
    """The eval settings of a composed JobConfig, against the data source they take held-out data from."""
    eval_cfg, passkey = cfg.eval, cfg.eval.passkey
    for name, value, least in (("every_steps", eval_cfg.every_steps, 0), ("sequences", eval_cfg.sequences, 1),
                               ("passkey.lengths", passkey.lengths or 0, 0), ("passkey.depths", passkey.depths, 1),
                               ("passkey.trials", passkey.trials, 1), ("passkey.every_steps", passkey.every_steps, 0)):
        if value < least:
            raise ConfigError(f"eval.{name}={value} must be at least {least}")
    if passkey.lengths and cfg.seq_len >> (passkey.lengths - 1) < 1:
        raise ConfigError(f"eval.passkey.lengths={passkey.lengths} halves seq_len={cfg.seq_len} down to nothing: set "
                          f"fewer, or leave it unset (derived from seq_len)")
    if not 0.0 <= eval_cfg.fraction < 1.0:
        raise ConfigError(f"eval.fraction={eval_cfg.fraction} must be in [0, 1) (e.g. 0.01 holds out 1% of the "
                          f"documents)")
    if passkey.filler not in PASSKEY_FILLERS:
        raise ConfigError(f"eval.passkey.filler={passkey.filler!r} is not one of {PASSKEY_FILLERS}")
    files = cfg.data.name == "files"
    if (eval_cfg.path or eval_cfg.fraction) and not files:
        raise ConfigError("eval.path and eval.fraction take held-out documents of data=files; the recall task "
                          "draws its held-out sequences from another seed: drop them")
    if eval_cfg.path and eval_cfg.fraction:
        raise ConfigError("eval.path and eval.fraction both name held-out data: set one of them")
    if files and evaluating(eval_cfg) and not (eval_cfg.path or eval_cfg.fraction):
        raise ConfigError("evaluation on data=files needs held-out documents: set eval.path=<files> or "
                          "eval.fraction=0.01 (1% of the training documents, held out of training)")
    if evaluating(eval_cfg) and cfg.parallel.shard and world_size() > 1:
        raise ConfigError("evaluation does not run under parallel.shard=true yet (the sharded head is whole only "
                          "inside the forward): set eval.every_steps=0, or evaluate checkpoints with "
                          "scripts/evaluate.py")
    if passkey.filler == "held_out" and not files:
        raise ConfigError("eval.passkey.filler=held_out needs held-out text (data=files): use builtin or auto")
