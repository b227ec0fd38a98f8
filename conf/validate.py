"""`validate(cfg)`: every config group's check, run once on the composed config before anything heavy is
built or written. Each check lives beside its group's dataclass in conf/schema/; `check_known_keys` here
holds the composed config to the schema, since Hydra accepts any `+key=value`."""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping

from conf.errors import ConfigError
from conf.schema import JobConfig
from conf.schema.data import check_data
from conf.schema.eval import check_eval
from conf.schema.job import check_job
from conf.schema.memory import check_memory, resolve_gpu_preset
from conf.schema.model import check_model
from conf.schema.optim import check_optim, resolve_optim
from conf.schema.parallel import check_parallel
from conf.schema.train import check_fp8, check_train

__all__ = ["ConfigError", "check_finite_numbers", "check_known_keys", "validate"]


def validate(cfg) -> str:
    """Raise ConfigError naming the fix for the first invalid setting found; fill the settings left to auto
    (optim.lr, optim.warmup_steps, memory.gpu's size). Returns the line saying which train mode, learning
    rate and warmup were taken and why."""
    check_known_keys(cfg)
    check_finite_numbers(cfg, JobConfig)
    check_job(cfg)
    check_train(cfg.train)
    check_parallel(cfg)
    training = resolve_optim(cfg)
    check_optim(cfg.optim, cfg.max_steps)
    check_model(cfg.model)
    check_memory(cfg.memory)
    check_fp8(cfg)
    resolve_gpu_preset(cfg.memory)
    check_data(cfg.data, cfg.seq_len, cfg.model.vocab_size, cfg.model.path)
    check_eval(cfg)
    return training


def check_known_keys(cfg) -> None:
    """ConfigError for the first key that is no field of the schema (a misspelling Hydra let through as
    `+key=value`), naming the nearest valid key where one is near. Dict-typed fields (model.rope_scaling)
    take any key."""
    for path in unknown_paths(cfg, JobConfig):
        raise unknown_setting(path)


def unknown_setting(path: str) -> ConfigError:
    """The one line for a setting `path` that is no field of the schema: the nearest valid key, and the keys of
    its group."""
    fields = schema_paths(JobConfig)
    parent, _, _ = path.rpartition(".")
    siblings = [name.rpartition(".")[2] for name in fields if name.rpartition(".")[0] == parent]
    near = nearest(path, fields)
    return ConfigError(f"unknown setting {path}" + (f": the nearest is {near}" if near else "")
                       + f" ({parent or 'the top level'} has: {', '.join(siblings) or 'no settings'})")


def check_override_keys(arguments: list[str], groups: set[str]) -> None:
    """ConfigError for the first command-line override `key=value` (no +, ++ or ~) whose key is neither a
    setting, a config group of `groups`, nor Hydra's: Hydra would stop with its advice to append it as
    `+key=...`, where the user meant an existing key. Keys under a free-form setting (model.rope_scaling.*) are
    left to Hydra."""
    fields = set(schema_paths(JobConfig))
    free_form = fields - {field.rpartition(".")[0] for field in fields}     # settings without fields of their own
    for argument in arguments:
        key, equals, _ = argument.partition("=")
        if not equals or argument.startswith(("-", "+", "~")) or not key.replace(".", "").replace("_", "").isalnum():
            continue
        if (key in fields or key in groups or key.split(".")[0] == "hydra"
                or any(key.startswith(f"{field}.") for field in free_form)):
            continue
        raise unknown_setting(key)


def check_finite_numbers(values, schema: type, prefix: str = "") -> None:
    """ConfigError for the first float setting (float, Optional[float] or List[float] in the schema, or a
    float item of a mapping such as model.rope_scaling) that is NaN or infinite: NaN passes every comparison
    a group's check makes, and either ends a run steps later."""
    for name, hint in typing.get_type_hints(schema).items():
        value = values[name]
        if (nested := nested_schema(hint)) and value is not None:
            check_finite_numbers(value, nested, f"{prefix}{name}.")
        elif isinstance(value, Mapping):
            check_finite_items(value, f"{prefix}{name}.")
        elif any(not finite(number) for number in float_values(hint, value)):
            raise ConfigError(f"{prefix}{name}={value} must be a finite number (not nan or inf)")


def check_finite_items(mapping: Mapping, prefix: str) -> None:
    """check_finite_numbers for a setting of free form (typed Any): its float items, at any depth."""
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            check_finite_items(value, f"{prefix}{key}.")
        elif not finite(value):
            raise ConfigError(f"{prefix}{key}={value} must be a finite number (not nan or inf)")


def finite(value) -> bool:
    """False for a float NaN or infinity only."""
    return not (isinstance(value, float) and not math.isfinite(value))


def float_values(hint, value) -> list:
    """The floats a setting of type `hint` holds: its value, or a List[float]'s items."""
    if value is None:
        return []
    if typing.get_origin(hint) is list:
        return list(value) if float in typing.get_args(hint) else []
    return [value] if float in (hint, *typing.get_args(hint)) else []


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


# A path this similar to a valid one (difflib's ratio; get_close_matches' default cutoff) is taken as its
# misspelling.
NEAR_RATIO = 0.6


def nearest(path: str, candidates: list[str]) -> str | None:
    """The valid path closest to `path`: the same name in another group first (`warmup_steps` ->
    `optim.warmup_steps`), then a name that abbreviates it by its words' initials (`learning_rate` -> `lr`),
    else the most similar by difflib, if at least NEAR_RATIO similar; None when none is near."""
    name = path.rpartition(".")[2]
    initials = "".join(word[0] for word in name.split("_") if word)

    def closeness(candidate: str) -> tuple:
        candidate_name = candidate.rpartition(".")[2]
        return (candidate_name == name, len(initials) > 1 and candidate_name == initials,
                difflib.SequenceMatcher(None, path, candidate).ratio())
    best = max(candidates, key=closeness)
    same_name, abbreviated, ratio = closeness(best)
    return best if same_name or abbreviated or ratio >= NEAR_RATIO else None
