"""The trainable weights and optimizer state of a run over several processes, in a checkpoint's state/
directory through torch.distributed.checkpoint (DCP).

Every rank writes its part (DCP writes a tensor replicated over the ranks once); rank 0 writes the metadata
when all parts are written. The tensors are named by parameter (the optimizer state too), not by rank, so
any number of processes reads them back, one process included: a job resumes on another world size.
Frozen weights (a LoRA base) are not saved: they come from model.path or the random init of the seed.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

STATE_DIR = "state"
# strict=False because the frozen weights are left out on purpose; dcp.load itself refuses a checkpoint
# that lacks a tensor the model trains.
OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_state, "optimizer": optimizer_state}


def _quietly(operation, *args, **kwargs):
    """DCP warns that it runs in one process when no process group exists: that is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return operation(*args, no_dist=not dist.is_initialized(), **kwargs)


def save_sharded_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this rank's part of the trainable weights and optimizer state into `directory` (collective:
    every rank calls it)."""
    _quietly(dcp.save, _state(model, optimizer), checkpoint_id=str(directory))


def load_sharded_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what save_sharded_state wrote, on any number of processes, into `model` and `optimizer`;
    raises when the checkpoint lacks a tensor of this model (other train.* settings)."""
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()      # StreamedAdamW: the moments DCP loads into must exist first
    state = _state(model, optimizer)
    _quietly(dcp.load, state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=OPTIONS)
    _check_every_parameter_has_state(model, optimizer)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer_state: dict) -> None:
    """Load a one-process checkpoint (whole weights by name; `optimizer_state` as torch's state_dict(),
    by parameter index) into a sharded (FSDP2) `model` and its optimizer: each rank keeps its shard."""
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()      # StreamedAdamW: the sharded moments each rank takes its part into
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    by_name = {"state": {names[index]: state for index, state in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True, strict=False))
    _check_every_parameter_has_state(model, optimizer)


def _check_every_parameter_has_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A loader that matched no state to a parameter would restart its moments silently: refuse instead."""
    missing = [name for name, param in model.named_parameters()
               if param.requires_grad and not optimizer.state.get(param)]
    if missing:
        raise ValueError(f"the checkpoint's optimizer state left {len(missing)} trainable parameters without "
                         f"moments (first: {missing[:3]})")


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights of a sharded `model`, whole and on the CPU, by name (collective: every rank
    calls it and gets them)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))


def sharded_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The trainable weights in `directory`, by parameter name, read in this one process (for export): the
    optimizer state stays on disk."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    weights = {key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
               for key, item in metadata.state_dict_metadata.items() if key.startswith("model.")}
    _quietly(dcp.load, {"model": weights}, checkpoint_id=str(directory))
    return weights
