"""The architecture a config describes and a run builds: model.path's config.json with the rope settings given
applied (every other architecture setting checked against it), or the model group's for random init;
recorded into the config so that config.yaml, checkpoints, W&B and the export describe the model built
(docs/LONG_CONTEXT.md)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from omegaconf import OmegaConf

from conf.schema.model import ARCHITECTURE_KEYS, GROUP_DIR, MISSING, ModelConfig
from conf.validate import ConfigError
from model import DecoderConfig
from model.families import DEFAULT_FAMILY, family_named
from model.hf_checkpoint import ROPE_OVERRIDE_KEYS, read_config, with_overrides

log = logging.getLogger(__name__)


def model_values(model_cfg) -> dict:
    """The model settings as a plain dict; a run recorded before model families were named built a Llama."""
    values = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    values.setdefault("family", DEFAULT_FAMILY)
    return values


def group_values(name: str) -> dict:
    """The model settings conf/model/<name>.yaml gives ({} for a name no group file has)."""
    file = GROUP_DIR / f"{name}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else {}
    nested = values.get("model")           # a file in the global package sets model.* under `model:`
    return nested if isinstance(nested, dict) else values


def given_model_keys(overrides: list[str]) -> set[str]:
    """The model settings a list of Hydra overrides gives: model.rope_theta=1e6 and +model.rope_scaling.factor=8
    give rope_theta and rope_scaling; model=tiny (the group) gives none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    keys = (override.key_or_group for override in OverridesParser.create().parse_overrides(overrides))
    return {key.split(".")[1] for key in keys if key.startswith("model.")}


def is_recorded(model_cfg) -> bool:
    """Whether model settings are a run's recorded architecture (record_architecture always writes an int
    head_dim; no model group sets one): then every value in them is the run's."""
    return model_cfg["head_dim"] is not None


def given_architecture(model_cfg: dict, given_keys: set[str] | None = None) -> dict:
    """The architecture settings of `model_cfg` (a plain dict) that were given rather than left to the model
    group or the schema: with model.path, these must agree with the checkpoint (or override its rope).
    `given_keys`: the model keys the command line gave (given_model_keys); without them a value equal to the
    group's counts as the group's, and record_architecture names those it drops."""
    values = {key: model_cfg[key] for key in ARCHITECTURE_KEYS if model_cfg[key] not in (None, MISSING)}
    if given_keys is not None:
        return {key: value for key, value in values.items() if key in given_keys}
    if is_recorded(model_cfg):
        return values
    group, defaults = group_values(model_cfg["name"]), ModelConfig()
    return {key: value for key, value in values.items() if value != group.get(key, getattr(defaults, key))}


def with_rope(base: DecoderConfig, values: dict) -> DecoderConfig:
    """`base` with the rope settings of `values` that are not None; ConfigError when they are not valid."""
    try:
        return with_overrides(base, {key: values.get(key) for key in ROPE_OVERRIDE_KEYS})
    except ValueError as error:
        raise ConfigError(f"model.rope_theta / model.rope_scaling / model.max_position_embeddings: {error} "
                          f"(docs/LONG_CONTEXT.md)") from None


def architecture(model_cfg) -> DecoderConfig:
    """The architecture the model settings describe on their own (random init, a run's recorded config); rope
    settings left None take DecoderConfig's defaults."""
    values = model_values(model_cfg)
    try:
        family_named(values["family"])
    except ValueError as error:
        raise ConfigError(f"model.family={values['family']!r}: {error}") from None
    base = DecoderConfig.from_dict({key: values[key] for key in ARCHITECTURE_KEYS if key != "rope_scaling"})
    return with_rope(base, {"rope_scaling": values["rope_scaling"]})


def checkpoint_architecture(cfg) -> DecoderConfig:
    """model.path's own architecture, as its config.json says: read once while that file is unchanged (a
    start asks for it many times), a copy each time."""
    path = Path(cfg.model.path).expanduser()
    config_file = path / "config.json"
    stamp = (config_file.stat().st_mtime_ns, config_file.stat().st_size) if config_file.is_file() else None
    return dataclasses.replace(read_checkpoint_config(str(path.resolve()), stamp))


@functools.lru_cache(maxsize=16)
def read_checkpoint_config(path: str, stamp: tuple[int, int] | None) -> DecoderConfig:
    """read_config of `path`, cached by the config.json's modification time and size (`stamp`)."""
    return read_config(Path(path))


def model_architecture(cfg, given_keys: set[str] | None = None) -> DecoderConfig:
    """The architecture the model is built with: with model.path its config.json's, the rope settings given
    (model.rope_theta, model.rope_scaling, model.max_position_embeddings) applied and any other architecture
    setting given checked against it (given_architecture); else the model group's."""
    if not cfg.model.path:
        return architecture(cfg.model)
    checkpoint = checkpoint_architecture(cfg)
    given = given_architecture(model_values(cfg.model), given_keys)
    for key, value in given.items():
        if key not in ROPE_OVERRIDE_KEYS and value != getattr(checkpoint, key):
            raise ConfigError(f"model.{key}={value} differs from {getattr(checkpoint, key)} in model.path's "
                              f"config.json ({cfg.model.path}): with model.path only model.rope_theta, "
                              f"model.rope_scaling and model.max_position_embeddings change the architecture; "
                              f"drop model.{key}")
    return with_rope(checkpoint, given)


def rope_overrides(arch: DecoderConfig) -> dict:
    """The rope settings of `arch` as loader overrides (CausalLM.from_pretrained), the default rope spelled out: a
    None would keep the checkpoint's scaling."""
    return {"rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling or {"rope_type": "default"},
            "max_position_embeddings": arch.max_position_embeddings}


def record_architecture(cfg, arch: DecoderConfig | None = None, given_keys: set[str] | None = None) -> DecoderConfig:
    """Write the architecture the model is built with (`arch`, default model_architecture with `given_keys`)
    into cfg.model (with model.path: the checkpoint's values and the overrides, not the model group's), so that
    config.yaml, every checkpoint and W&B record it, and a resume that would build another (a changed rope) is
    refused like a changed seq_len. The default rope is recorded as {rope_type: default}: null would mean
    model.path's scaling. Settings in cfg.model that the model built does not have are named in one line."""
    if arch is None:
        arch = model_architecture(cfg, given_keys)
        log_unused(cfg, arch, given_keys)
    recorded = {key: getattr(arch, key) for key in ARCHITECTURE_KEYS} | rope_overrides(arch)
    for key in ARCHITECTURE_KEYS:
        cfg.model[key] = recorded[key]
    return arch


def log_unused(cfg, arch: DecoderConfig, given_keys: set[str] | None) -> None:
    """One line naming the model group's settings that model.path's architecture replaces (a warning without
    the command line's keys: one of them may have been given, equal to the group's)."""
    if not cfg.model.path or is_recorded(cfg.model):
        return
    values = model_values(cfg.model)
    built = {key: getattr(arch, key) for key in ARCHITECTURE_KEYS} | {"rope_scaling": arch.rope_type}
    values["rope_scaling"] = (values["rope_scaling"] or {}).get("rope_type", "default")
    unused = [f"model.{key}={values[key]} (built: {built[key]})" for key in ARCHITECTURE_KEYS
              if values[key] not in (None, MISSING) and values[key] != built[key]]
    if unused:
        level = logging.INFO if given_keys is not None else logging.WARNING
        log.log(level, "model.path's config.json replaces model=%s's %s (docs/LONG_CONTEXT.md: only the rope "
                "settings override it)", cfg.model.name, ", ".join(unused))


def saved_config(saved_yaml: str):
    """A run's saved config.yaml with the architecture the run built recorded in it (record_architecture).
    Runs from before it was recorded (head_dim null: record_architecture always writes an int) saved their
    model group's and the schema's values beside model.path, and built model.path's config.json whatever they
    said (c729dfe): that is what is recorded for them, so that their max_position_embeddings 8192 or rope_theta
    500000 are not read as rope overrides."""
    saved = OmegaConf.create(saved_yaml)
    unrecorded = saved.model.path and saved.model.get("head_dim") is None
    record_architecture(saved, checkpoint_architecture(saved) if unrecorded else None)
    return saved


def rope_changes(arch: DecoderConfig, checkpoint: DecoderConfig) -> dict:
    """The rope settings in which `arch` differs from `checkpoint` ({} for none)."""
    return {key: getattr(arch, key) for key in ROPE_OVERRIDE_KEYS if getattr(arch, key) != getattr(checkpoint, key)}


def context_summary(cfg) -> str:
    """The startup summary's rope line: the rope built, what changed from model.path's, and when seq_len
    goes beyond the checkpoint's context with its rope unchanged, the overrides that would extend it."""
    arch = model_architecture(cfg)
    scaling = ", ".join(f"{key} {value}" for key, value in (arch.rope_scaling or {}).items() if key != "rope_type")
    line = (f"{arch.rope_type}{f' ({scaling})' if scaling else ''}, theta {arch.rope_theta:g}, "
            f"max_position_embeddings {arch.max_position_embeddings}")
    if not cfg.model.path:
        return line
    checkpoint = checkpoint_architecture(cfg)
    changed = rope_changes(arch, checkpoint)
    if changed:
        line += f"; changed from model.path's: {', '.join(f'model.{key}' for key in changed)}"
    context = checkpoint.max_position_embeddings
    if cfg.seq_len <= context or {"rope_theta", "rope_scaling"} & set(changed):
        return line
    dim = arch.head_dim
    theta = checkpoint.rope_theta * (cfg.seq_len / context) ** (dim / (dim - 2))     # NTK-aware base
    return (line + f"; WARNING: seq_len={cfg.seq_len} is beyond model.path's max_position_embeddings {context} with "
            f"its rope unchanged: to extend it, model.rope_scaling='{{rope_type: yarn, factor: "
            f"{cfg.seq_len / context:g}, original_max_position_embeddings: {context}}}' "
            f"model.max_position_embeddings={cfg.seq_len}, or model.rope_theta={theta:.3g} (docs/LONG_CONTEXT.md)")


def trained_context(cfg) -> int | None:
    """The context model.path was trained for (its max_position_embeddings); None for random init."""
    return checkpoint_architecture(cfg).max_position_embeddings if cfg.model.path else None
