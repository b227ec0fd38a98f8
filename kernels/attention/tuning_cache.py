"""Autotuning choices kept on disk, so that a resumed or repeated job starts at full speed.

At 131k tokens the attention autotuner spends about a minute of the first step timing every candidate
config. `autotune` here is `triton.autotune` whose choice, once made, is written to one small JSON file per
kernel and tuning key in the cache directory, and read back by the next process instead of timing again.

Directory: $LONGCTX_TUNING_CACHE, default ~/.cache/longctx/triton-tuning; "off" (or empty) disables it.

An entry is trusted only if everything that decides the choice is unchanged: the GPU's name, the architecture
the kernels are compiled for (TRITON_OVERRIDE_ARCH=sm80 compiles the A100's code on a newer GPU), Triton's
version, the kernel's source (with the functions it calls), the tuning key (sequence bucket, head dim, group,
masking, dtypes) and the candidate list. The file stores that identity in full and is used only if it
matches exactly, and the choice is returned only as one of today's candidate objects (never built from the
file). Anything else - unreadable JSON, a foreign or stale identity, a choice that is no candidate - is
ignored with a warning and tuned again; a cache that cannot be written only warns. A stale entry (the same
kernel and tuning key from an older Triton or kernel source, or from another GPU) lies under another file
name, since the name hashes the identity: it is found by the kernel's name on a miss, and what it was
written for is named.

Triton's own `cache_results=True` (TRITON_CACHE_AUTOTUNING) stores timings under TRITON_CACHE_DIR, but keys
on the compute capability rather than the GPU (an H100 PCIe and an H200 would share choices) and fails on a
corrupt file; this module reuses its hook, `Autotuner.check_disk_cache`, with the checks above.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
import triton
from triton.runtime.autotuner import Autotuner

CACHE_DIR_ENV = "LONGCTX_TUNING_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/longctx/triton-tuning")
FORMAT_VERSION = 1
# An entry's identity fields as a warning names them.
FIELD_NAMES = {"gpu": "GPU", "arch": "compile target", "triton": "Triton version", "source": "kernel source",
               "candidates": "list of candidate configs", "format": "cache format"}


def cache_dir() -> Path | None:
    """The cache directory, or None when $LONGCTX_TUNING_CACHE is "off" or empty."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value is None:
        return DEFAULT_CACHE_DIR.expanduser()
    if value.strip().lower() in ("", "off"):
        return None
    return Path(value).expanduser()


def device_identity() -> dict:
    """The GPU this process tunes on and the architecture its kernels are compiled for."""
    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "arch": triton.knobs.runtime.override_arch or f"sm{major}{minor}",
            "triton": triton.__version__}


def entry_identity(kernel: str, source: str, device: dict, tuning_key: tuple, candidates) -> dict:
    """Everything an entry's choice depends on, as plain JSON values."""
    return {"format": FORMAT_VERSION, **device, "kernel": kernel, "source": source,
            "key": [str(part) for part in tuning_key], "candidates": [str(config) for config in candidates]}


def entry_path(directory: Path, identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return directory / f"{identity['kernel']}-{digest}.json"


def load_choice(directory: Path, identity: dict, candidates):
    """The candidate config stored for `identity`, or None (missing, or ignored with a warning)."""
    path = entry_path(directory, identity)
    try:
        text = path.read_text()
    except FileNotFoundError:
        _warn_if_stale(directory, identity)
        return None
    except OSError as error:
        warnings.warn(f"tuning cache: cannot read {path} ({error}); tuning again")
        return None
    try:
        entry = json.loads(text)
        stored_identity, choice = entry["identity"], entry["choice"]
    except (ValueError, TypeError, KeyError) as error:
        warnings.warn(f"tuning cache: {path} is corrupt ({error!r}); ignored, tuning again")
        return None
    if stored_identity != identity:
        warnings.warn(f"tuning cache: {path} was written for another kernel, GPU or Triton; ignored")
        return None
    by_name = {str(config): config for config in candidates}
    if not isinstance(choice, str) or choice not in by_name:
        warnings.warn(f"tuning cache: {path} names {choice!r}, which is no candidate config; ignored")
        return None
    return by_name[choice]


def _warn_if_stale(directory: Path, identity: dict) -> None:
    """On a miss: if another entry holds this kernel's choice for the same tuning key, say what it was written
    for (an older Triton or kernel source: stale; another GPU sharing the directory: another machine's), the
    entry differing in the fewest fields, and that it is not used."""
    closest = None
    try:
        paths = sorted(directory.glob(f"{identity['kernel']}-*.json"))
    except OSError:
        return
    for path in paths:
        try:
            stored = json.loads(path.read_text())["identity"]
            if stored["kernel"] != identity["kernel"] or stored["key"] != identity["key"]:
                continue
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
            continue     # unreadable: the lookup of its own identity says so
        changed = [field for field in identity if stored.get(field) != identity[field]]
        if changed and (closest is None or len(changed) < len(closest[1])):
            closest = path, changed
    if closest is not None:
        path, changed = closest
        warnings.warn(f"tuning cache: {path} holds this kernel's choice for the same key, written for another "
                      f"{', '.join(FIELD_NAMES.get(field, field) for field in changed)}; not used, tuning again")


def store_choice(directory: Path, identity: dict, config) -> None:
    """Write the entry atomically (a reader never sees half a file); failing to write only warns."""
    path = entry_path(directory, identity)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as tmp:
            json.dump({"identity": identity, "choice": str(config)}, tmp, indent=1)
        os.replace(tmp.name, path)
    except OSError as error:
        warnings.warn(f"tuning cache: cannot write {path} ({error}); the choice is kept for this process only")


class CachedAutotuner(Autotuner):
    """`triton.autotune` whose choices persist in `cache_dir()` (see the module doc)."""

    def __init__(self, fn, configs, key):
        super().__init__(fn, fn.arg_names, configs, key, reset_to_zero=None, restore_value=None,
                         cache_results=True)   # turns on the check_disk_cache hook (never under the interpreter)

    def check_disk_cache(self, tuning_key, configs, bench_fn) -> bool:
        """Triton's hook when a key is not in memory: set self.cache[tuning_key]; True if read from disk."""
        directory = cache_dir()
        if directory is None:
            bench_fn()
            return False
        identity = entry_identity(self.base_fn.__name__, self.fn.cache_key, device_identity(), tuning_key, configs)
        choice = load_choice(directory, identity, configs)
        if choice is not None:
            self.cache[tuning_key] = choice
            return True
        bench_fn()
        store_choice(directory, identity, self.cache[tuning_key])
        return False


def autotune(configs, key):
    """Decorator like `triton.autotune(configs, key)`, with choices kept on disk."""
    return lambda fn: CachedAutotuner(fn, configs, key)
