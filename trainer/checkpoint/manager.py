"""The checkpoints of one run, <run dir>/checkpoints/step-<N>/ (format: trainer.checkpoint.format): when
the next periodic one is due, writing one crash-safely, keeping the newest keep_last, and reading and
restoring one. Only complete checkpoints are ever deleted, and only by keep_last.

A checkpoint is written into a temporary sibling directory, every file flushed to disk, the directory
renamed into place, and only then the COMPLETE marker is written. Older checkpoints are deleted only after
a newer one is complete, so a crash at any moment leaves the previous checkpoint usable.
"""
from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import torch

from model.hf_checkpoint import is_lora
from storage.atomic import TEMP_PREFIX, atomic_directory, fresh_temp_directory, publish_directory
from trainer.checkpoint.disk_space import check_free_disk, checkpoint_size
from trainer.checkpoint.format import (ADAPTER_DIR, CHECKPOINTS_DIR, CheckpointError, LoadedCheckpoint, Progress,
                                       complete_checkpoints, content_problem, empty_step_dirs, read_checkpoint,
                                       step_dir, step_dirs, step_of, write_checkpoint, write_complete_marker)
from trainer.checkpoint.rng_state import restore_rng_state
from trainer.checkpoint.sharded_state import load_full_state, load_sharded_state
from trainer.distributed import World
from trainer.optim import continue_schedule
from trainer.sharding import is_sharded


class CheckpointManager:
    """Saves every `every_steps` steps or `every_minutes` minutes (0: off), keeps the newest `keep_last`
    complete checkpoints under `root` (0: all), and loads one back."""

    def __init__(self, root: Path, every_steps: int = 0, every_minutes: float = 0, keep_last: int = 0):
        self.root = root
        self.every_steps, self.every_seconds, self.keep_last = every_steps, every_minutes * 60, keep_last
        # What read_newest skipped: step directory -> why it cannot be resumed from.
        self.skipped: dict[Path, str] = {}
        self.restart_interval(0)

    @classmethod
    def for_run(cls, run_dir: Path, checkpoint_cfg) -> CheckpointManager:
        """The manager of <run_dir>/checkpoints, with the interval and keep_last of cfg.checkpoint."""
        return cls(run_dir / CHECKPOINTS_DIR, checkpoint_cfg.every_steps, checkpoint_cfg.every_minutes,
                   checkpoint_cfg.keep_last)

    # ------------------------------------------------------------------------------------------- interval

    def restart_interval(self, step: int) -> None:
        """Count the interval to the next periodic save from now and from `step` (the last one saved, or
        the one a resumed run starts from)."""
        self.last_saved_at, self.last_saved_step = time.monotonic(), step

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after `step`.

        A multiple of `every_steps` passed without a save (its step was skipped as NaN/Inf, and periodic saves
        wait for a good step) keeps the save due until it happens, instead of dropping it until the next
        multiple.
        """
        by_steps = self.every_steps > 0 and step // self.every_steps > self.last_saved_step // self.every_steps
        return by_steps or (self.every_seconds > 0 and time.monotonic() - self.last_saved_at >= self.every_seconds)

    # -------------------------------------------------------------------------------------------- writing

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, data, progress: Progress,
             config_yaml: str, world: World = World.single()) -> Path:
        """Write checkpoint step-<progress.step>, then delete those keep_last no longer keeps; returns its
        path. Over several processes every rank calls it: each writes its part, and rank 0 renames the
        directory into place and writes the marker once all have written."""
        final = step_dir(self.root, progress.step)
        size = checkpoint_size(model, optimizer)
        world.on_main(lambda: self._prepare(size))
        if world.distributed:
            checksums = self._write_together(final, world, lambda temp: write_checkpoint(
                temp, model, optimizer, scheduler, data, progress, config_yaml, world))
        else:
            with atomic_directory(final) as temp:
                checksums = write_checkpoint(temp, model, optimizer, scheduler, data, progress, config_yaml)
        # No rank goes on (to a resume, or the next save) before the checkpoint is complete.
        world.on_main(lambda: self._complete(final, checksums))
        self.restart_interval(progress.step)
        return final

    def _prepare(self, size: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TEMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)    # left by a save that was killed
        check_free_disk(self.root, size)

    def _complete(self, final: Path, checksums: dict[str, str]) -> None:
        write_complete_marker(final, checksums)
        self.prune()

    @staticmethod
    def _write_together(final: Path, world: World, write) -> dict[str, str]:
        """Every rank `write`s into one temporary directory that rank 0 made; rank 0 publishes it when all
        have written. Returns what `write` returned (the checksums it computed)."""
        temp = world.main_value(fresh_temp_directory(final, "ranks") if world.is_main else None)
        checksums = write(temp)
        world.barrier()
        world.on_main(lambda: publish_directory(temp, final))
        return checksums

    def prune(self) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (0 keeps all). A directory that is not a
        complete checkpoint is never deleted: it may hold the only intact copy of some state."""
        complete = self.complete()
        for directory in complete[:-self.keep_last] if self.keep_last else []:
            shutil.rmtree(directory, ignore_errors=True)

    def set_aside_after(self, step: int) -> list[tuple[Path, Path]]:
        """Rename the step directories newer than `step` (checkpoints a resume from `step` skipped as
        unreadable) to step-<N>.unreadable, so that the saves of the resumed run neither replace nor prune
        them; returns (old, new) paths."""
        moved = []
        for directory in step_dirs(self.root):
            if step_of(directory) > step:
                target, attempt = directory.with_name(f"{directory.name}.unreadable"), 1
                while target.exists():
                    attempt += 1
                    target = directory.with_name(f"{directory.name}.unreadable-{attempt}")
                moved.append((directory, directory.rename(target)))
        return moved

    def remove_empty(self) -> list[Path]:
        """Remove the empty step directories (empty_step_dirs); returns them. rmdir removes only an empty
        directory, so nothing written meanwhile is lost."""
        removed = []
        for directory in empty_step_dirs(self.root):
            with contextlib.suppress(OSError):      # no longer empty, or gone: not ours to remove
                directory.rmdir()
                removed.append(directory)
        return removed

    # -------------------------------------------------------------------------------------------- reading

    def complete(self) -> list[Path]:
        """The complete checkpoints under `root`, oldest first."""
        return complete_checkpoints(self.root)

    def last_good(self, last: Path | None) -> Path | None:
        """`last` (the checkpoint this job last wrote or resumed from) if its files still match their
        checksums, else the newest older checkpoint of this run directory that does; None when none does.
        Reads every byte of the checkpoints it checks: for the message of a job that stops."""
        if last is None:
            return None
        older = [d for d in reversed(self.complete()) if step_of(d) < step_of(last)]
        return next((d for d in [last, *older] if content_problem(d) is None), None)

    def read(self, path: Path, verify: bool = True) -> LoadedCheckpoint:
        """The checkpoint at `path`, which may belong to another run; CheckpointError if anything is off
        (`verify`: its checksums too, see read_checkpoint)."""
        return read_checkpoint(path, verify)

    def read_newest(self) -> LoadedCheckpoint | None:
        """The newest readable checkpoint under `root`, None when there is none; broken ones are skipped (kept
        in `skipped`, for the line that sets them aside), and when every one is broken, CheckpointError lists
        them: starting over would lose them."""
        self.skipped = {}
        for directory in reversed(step_dirs(self.root)):
            try:
                return self.read(directory)
            except CheckpointError as error:
                self.skipped[directory] = str(error)
        if self.skipped:
            listing = "\n  ".join(self.skipped.values())
            raise CheckpointError(
                f"no checkpoint in {self.root} can be resumed from:\n  {listing}\nNothing was changed. Repair "
                f"them, or move them (and metrics.jsonl) out of the run directory to start over in it; "
                f"resume=<path> continues from a good checkpoint elsewhere; or give a new output_dir.")
        return None

    def restore(self, loaded: LoadedCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler, data, force: bool = False, world: World = World.single()) -> Progress:
        """Put model, optimizer, data pipeline and RNGs back in the checkpoint's state, and the scheduler at
        its step (of this job's schedule); `force` (resume_force) accepts a data state saved for other data."""
        if loaded.state_dir is not None:
            self._restore_sharded(loaded, model, optimizer)
        else:
            self._restore_files(loaded, model, optimizer)
        continue_schedule(scheduler, loaded.trainer_state["scheduler"])
        data.load_state_dict(loaded.trainer_state["data"], force=force)
        restore_rng_state(loaded.trainer_state["rng"], world.rank, world.size)
        return loaded.progress

    @staticmethod
    def _restore_sharded(loaded: LoadedCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        try:
            load_sharded_state(loaded.state_dir, model, optimizer)
        except Exception as error:      # DCP names the first tensor that is missing or of another shape
            raise CheckpointError(f"{loaded.path}: its {loaded.state_dir.name}/ does not fit this model "
                                  f"(train.* or model.* settings differ?): {error}") from error
        if not is_lora(model):
            model.tie_weights()

    @staticmethod
    def _restore_files(loaded: LoadedCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not is_lora(model) and (loaded.path / ADAPTER_DIR).is_dir():
            raise CheckpointError(f"{loaded.path} holds a LoRA adapter but train.mode=full: resume with "
                                  f"train=lora")
        if is_sharded(model):     # a one-process checkpoint resumed over several (FSDP2): each rank its shard
            weights = adapter_by_parameter(loaded, model) if is_lora(model) else whole_weights(loaded, model)
            load_full_state(model, optimizer, weights, loaded.optimizer)
            return
        if is_lora(model):
            # Into the parameters by name, not through peft's set_peft_model_state_dict, which asks the whole
            # model's state_dict: with an FP8 base (model/fp8.py) that builds a bf16 copy of every weight.
            parameters = dict(model.named_parameters())
            with torch.no_grad():
                for name, tensor in adapter_by_parameter(loaded, model).items():
                    parameters[name].copy_(tensor)
        else:
            model.load_state_dict(whole_weights(loaded, model), strict=False)
            model.tie_weights()
        optimizer.load_state_dict(loaded.optimizer)


def shape_differences(loaded: LoadedCheckpoint, model: torch.nn.Module) -> list[str]:
    """'<name> is [..] in the checkpoint, [..] here' for each saved tensor whose shape is not that of
    `model`'s tensor of that name (none for a state/ directory, which DCP checks as it loads)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    here = ({disk: tensors[name].shape for disk, name in adapter_names(model).items()} if is_lora(model) else
            {name: tensor.shape for name, tensor in tensors.items()})
    return [f"{name} is {list(saved.shape)} in the checkpoint, {list(here[name])} here"
            for name, saved in loaded.weights.items() if name in here and saved.shape != here[name]]


def whole_weights(loaded: LoadedCheckpoint, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full fine-tuning checkpoint's weights, checked against `model`'s names. A tied head is saved once,
    as the embedding (full_weights): the only name allowed to be absent."""
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(names - set(loaded.weights) - tied)
    unexpected = sorted(set(loaded.weights) - names - tied)
    if missing or unexpected:
        raise CheckpointError(f"{loaded.path}: model.safetensors does not fit this model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}; model.* settings differ?)")
    return loaded.weights


def adapter_names(model: torch.nn.Module) -> dict[str, str]:
    """The names of a peft `model`'s adapter tensors on disk -> its parameters' names: peft leaves the
    adapter's name ("default") out of the names on disk."""
    return {name.replace(f".{model.active_adapter}.", "."): name
            for name, param in model.named_parameters() if param.requires_grad}


def adapter_by_parameter(loaded: LoadedCheckpoint, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors under the names of `model`'s parameters."""
    on_disk = adapter_names(model)
    unexpected = sorted(set(loaded.weights) - set(on_disk))
    missing = sorted(set(on_disk) - set(loaded.weights))
    if unexpected or missing:
        raise CheckpointError(f"{loaded.path}: adapter tensors do not fit this model (unexpected {unexpected[:5]}, "
                              f"missing {missing[:5]}; train.* LoRA settings differ?)")
    return {on_disk[key]: tensor for key, tensor in loaded.weights.items()}
