"""`validate(cfg)`: every config group's check, run once on the composed config before anything heavy is
built or written. Each check lives beside its group's dataclass in conf/schema/; `check_known_keys` here
holds the composed config to the schema, since Hydra accepts any `+key=value`."""
from __future__ import annotations

import dataclasses
import difflib
import typing

from conf.errors import ConfigError
from conf.schema import JobConfig
from conf.schema.data import check_data
from conf.schema.eval import check_eval
from conf.schema.job import check_job
from conf.schema.memory import check_memory, resolve_gpu_preset
from conf.schema.model import check_model
from conf.schema.optim import check_optim, resolve_optim
from conf.schema.parallel import check_parallel
from conf.schema.train import check_train

__all__ = ["ConfigError", "check_known_keys", "validate"]


def validate(cfg) -> str:
    """Raise ConfigError naming the fix for the first invalid setting found; fill the settings left to auto
    (optim.lr, optim.warmup_steps, memory.gpu's size). Returns the line saying which train mode, learning
    rate and warmup were taken and why."""
    check_known_keys(cfg)
    check_job(cfg)
    check_train(cfg.train)
    check_parallel(cfg)
    training = resolve_optim(cfg)
    check_optim(cfg.optim, cfg.max_steps)
    check_model(cfg.model)
    check_memory(cfg.memory)
    resolve_gpu_preset(cfg.memory)
    check_data(cfg.data, cfg.seq_len, cfg.model.vocab_size, cfg.model.path)
    check_eval(cfg)
    return training


def check_known_keys(cfg) -> None:
    """ConfigError for the first key that is no field of the schema (a misspelling Hydra let through as
    `+key=value`), naming the nearest valid key. Dict-typed fields (model.rope_scaling) take any key."""
    fields = schema_paths(JobConfig)
    for path in unknown_paths(cfg, JobConfig):
        parent, _, _ = path.rpartition(".")
        siblings = [name.rpartition(".")[2] for name in fields if name.rpartition(".")[0] == parent]
        raise ConfigError(f"unknown setting {path}: the nearest is {nearest(path, fields)} "
                          f"({parent or 'the top level'} has: {', '.join(siblings)})")


def nested_schema(hint) -> type | None:
    """The dataclass a field holds (through Optional), else None."""
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def schema_paths(schema: type, prefix: str = "") -> list[str]:
    """Every setting's dotted path, groups included."""
    paths = []
    for name, hint in typing.get_type_hints(schema).items():
        paths.append(prefix + name)
        if nested := nested_schema(hint):
            paths += schema_paths(nested, f"{prefix}{name}.")
    return paths


def unknown_paths(values, schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    unknown = []
    for key in values.keys():
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif (nested := nested_schema(hints[key])) and hasattr(values[key], "keys"):
            unknown += unknown_paths(values[key], nested, f"{prefix}{key}.")
    return unknown


def nearest(path: str, candidates: list[str]) -> str:
    """The valid path closest to `path`: the same name in another group first (`warmup_steps` ->
    `optim.warmup_steps`), then a name that abbreviates it by its words' initials (`learning_rate` -> `lr`),
    else by difflib's similarity."""
    name = path.rpartition(".")[2]
    initials = "".join(word[0] for word in name.split("_") if word)

    def closeness(candidate: str) -> tuple:
        candidate_name = candidate.rpartition(".")[2]
        return (candidate_name == name, len(initials) > 1 and candidate_name == initials,
                difflib.SequenceMatcher(None, path, candidate).ratio())
    return max(candidates, key=closeness)
