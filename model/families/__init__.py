"""The registry of model families: the built-in ones (one module each) registered here, by name and by the
config.json `model_type` they load (model/family.py says what a family is)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.qwen2 import QWEN2
from model.families.qwen3 import QWEN3
from model.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {}
# The family of a config that names none: our configs before families were named, config.json files before
# transformers wrote model_type (conf/schema/model.py, which imports no model code, spells it out too).
DEFAULT_FAMILY = LLAMA.name


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` known by its name and model types (a model type another family claims is an error)."""
    for known in FAMILIES.values():
        shared = sorted(set(known.model_types) & set(family.model_types))
        if known.name != family.name and shared:
            raise ValueError(f"family {family.name!r} claims model_type {shared}, which is {known.name!r}'s")
    FAMILIES[family.name] = family
    return family


def family_named(name: str) -> ModelFamily:
    """The family called `name` (model.family); ValueError listing the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def family_of_config(values: Mapping[str, Any]) -> ModelFamily:
    """The family a Hugging Face config.json describes (its `model_type`, else its `architectures`)."""
    model_type = values.get("model_type")
    architectures = values.get("architectures") or ()
    for family in FAMILIES.values():
        if model_type in family.model_types or (model_type is None and family.hf_architecture in architectures):
            return family
    described = f"model_type={model_type!r}" if model_type else f"architectures={list(architectures)}"
    known = ", ".join(f"{family.name} ({'/'.join(family.model_types)})" for family in FAMILIES.values())
    raise ValueError(f"it describes {described}, which is not a model family built here: {known}")


for _family in (LLAMA, QWEN2, QWEN3, MISTRAL):
    register_family(_family)
