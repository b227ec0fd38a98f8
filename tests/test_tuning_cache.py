"""kernels.attention.tuning_cache: autotuning choices on disk; a stale, foreign or corrupt entry is never trusted.

The cache logic runs on the CPU; the hook is driven the way Triton's Autotuner.run drives it when a tuning
key is not yet in memory (check_disk_cache with the key, the candidates and the benchmark to run).
"""
import conftest_kernels  # noqa: F401  (interpreter or compiler settled before triton loads)

import json

import pytest
import triton
from triton.runtime.jit import JITFunction

from kernels.attention import tuning_cache

CANDIDATES = [triton.Config({"BLOCK": 64}, num_warps=4, num_stages=3),
              triton.Config({"BLOCK": 128}, num_warps=8, num_stages=2)]
DEVICE = {"gpu": "NVIDIA A100-SXM4-80GB", "arch": "sm80", "triton": triton.__version__}
KEY = (32768, 128, 4, True, False, "torch.bfloat16")


def _identity(**changes):
    fields = dict(kernel="_attn_fwd_kernel", source="abc", device=DEVICE, tuning_key=KEY, candidates=CANDIDATES)
    fields.update(changes)
    return tuning_cache.entry_identity(**fields)


def test_a_stored_choice_reads_back_as_the_candidate_object(tmp_path):
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[1])
    assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is CANDIDATES[1]
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]      # no temporary file left behind


def test_missing_entry_is_silent(tmp_path, recwarn):
    assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is None
    assert not recwarn.list


@pytest.mark.parametrize("changes", [
    {"device": {**DEVICE, "gpu": "NVIDIA H100 80GB HBM3"}},
    {"device": {**DEVICE, "arch": "sm90"}},
    {"device": {**DEVICE, "triton": "0.0.1"}},
    {"source": "kernel edited"},
    {"tuning_key": (65536, *KEY[1:])},
    {"candidates": CANDIDATES[:1]},
])
def test_any_change_of_identity_finds_no_entry(tmp_path, changes, recwarn):
    """No entry is read; the entry left is named in a warning, unless it is for another tuning key."""
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[0])
    assert tuning_cache.load_choice(tmp_path, _identity(**changes), CANDIDATES) is None
    assert [("same key" in str(warning.message)) for warning in recwarn] == ([] if "tuning_key" in changes else [True])


@pytest.mark.parametrize("changes,named", [
    ({"device": {**DEVICE, "triton": "0.0.1"}}, "Triton version"),
    ({"device": {**DEVICE, "gpu": "NVIDIA H100 80GB HBM3"}}, "GPU"),
    ({"device": {**DEVICE, "arch": "sm90"}}, "compile target"),
    ({"source": "kernel edited"}, "kernel source"),
])
def test_an_entry_for_the_same_key_under_another_identity_is_named_in_a_warning(tmp_path, changes, named):
    """The entry of the same kernel and tuning key from before an upgrade or an edit, or from another GPU,
    lies under another file name: the miss finds it and says what it was written for."""
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[0])
    with pytest.warns(UserWarning, match=f"same key, written for another {named}; not used"):
        assert tuning_cache.load_choice(tmp_path, _identity(**changes), CANDIDATES) is None


def test_the_warning_names_the_closest_of_several_entries(tmp_path):
    """Of an A100 entry of this Triton and an entry of this GPU from another Triton, the second is the one this
    run would have used but for the upgrade."""
    this_gpu = {**DEVICE, "gpu": "NVIDIA H100 80GB HBM3", "arch": "sm90"}
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[0])
    tuning_cache.store_choice(tmp_path, _identity(device={**this_gpu, "triton": "0.0.1"}), CANDIDATES[0])
    with pytest.warns(UserWarning, match="written for another Triton version; not used") as warned:
        assert tuning_cache.load_choice(tmp_path, _identity(device=this_gpu), CANDIDATES) is None
    assert len(warned) == 1


def test_entries_of_other_keys_and_kernels_and_copies_are_not_named(tmp_path, recwarn):
    """Another sequence bucket, or another kernel, is a plain miss, and so is a corrupt file of another key
    (its own lookup warns) and an entry of this identity under another name."""
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[0])
    tuning_cache.store_choice(tmp_path, _identity(kernel="_attn_bwd_dq_kernel", source="x"), CANDIDATES[0])
    (tmp_path / "_attn_fwd_kernel-000000000000000000000000.json").write_text("{not json")
    assert tuning_cache.load_choice(tmp_path, _identity(tuning_key=(65536, *KEY[1:])), CANDIDATES) is None
    assert tuning_cache.load_choice(tmp_path, _identity(kernel="_attn_fwd", source="x"), CANDIDATES) is None
    # this very entry under another name (renamed by hand): nothing differs, nothing to name
    tuning_cache.entry_path(tmp_path, _identity()).rename(tmp_path / "_attn_fwd_kernel-backup.json")
    assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is None
    assert not recwarn.list


def _entry_file(tmp_path):
    tuning_cache.store_choice(tmp_path, _identity(), CANDIDATES[1])
    return tuning_cache.entry_path(tmp_path, _identity())


@pytest.mark.parametrize("content", ["{not json", "", "[]", '{"choice": 1}', "null"])
def test_corrupt_file_is_ignored_with_a_warning(tmp_path, content):
    _entry_file(tmp_path).write_text(content)
    with pytest.warns(UserWarning, match="corrupt"):
        assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is None


def test_foreign_entry_under_the_same_name_is_ignored(tmp_path):
    """A file whose stored identity differs from the one asked for (copied from another machine, or a hash
    collision) is not trusted."""
    path = _entry_file(tmp_path)
    entry = json.loads(path.read_text())
    entry["identity"]["gpu"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="another kernel, GPU or Triton"):
        assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is None


def test_a_choice_that_is_no_candidate_is_ignored(tmp_path):
    path = _entry_file(tmp_path)
    entry = json.loads(path.read_text())
    for choice in (str(triton.Config({"BLOCK": 4096}, num_warps=32, num_stages=9)), ["BLOCK"], None):
        entry["choice"] = choice
        path.write_text(json.dumps(entry))
        with pytest.warns(UserWarning, match="no candidate"):
            assert tuning_cache.load_choice(tmp_path, _identity(), CANDIDATES) is None


def test_unwritable_directory_only_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cannot write"):
        tuning_cache.store_choice(blocker / "cache", _identity(), CANDIDATES[0])


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning_cache.CACHE_DIR_ENV, raising=False)
    assert tuning_cache.cache_dir() == tuning_cache.DEFAULT_CACHE_DIR.expanduser()
    monkeypatch.setenv(tuning_cache.CACHE_DIR_ENV, str(tmp_path))
    assert tuning_cache.cache_dir() == tmp_path
    for off in ("off", "", "OFF"):
        monkeypatch.setenv(tuning_cache.CACHE_DIR_ENV, off)
        assert tuning_cache.cache_dir() is None


def _kernel(x_ptr, BLOCK: triton.language.constexpr):
    pass


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(tuning_cache, "device_identity", lambda: DEVICE)
    return lambda: tuning_cache.CachedAutotuner(JITFunction(_kernel), CANDIDATES, ["BLOCK"])


def _benchmark(tuner, runs):
    def bench():
        runs.append(1)
        tuner.cache[KEY] = CANDIDATES[1]
    return bench


def test_a_second_process_reads_the_first_ones_choice_without_tuning(tuner):
    runs = []
    first = tuner()
    assert first.check_disk_cache(KEY, CANDIDATES, _benchmark(first, runs)) is False
    second = tuner()                      # a new process: empty in-memory cache
    assert second.check_disk_cache(KEY, CANDIDATES, _benchmark(second, runs)) is True
    assert second.cache[KEY] is CANDIDATES[1] and len(runs) == 1


def test_a_corrupt_entry_is_tuned_again_and_rewritten(tuner, tmp_path):
    runs = []
    first = tuner()
    first.check_disk_cache(KEY, CANDIDATES, _benchmark(first, runs))
    for path in tmp_path.iterdir():
        path.write_text("garbage")
    second = tuner()
    with pytest.warns(UserWarning, match="corrupt"):
        assert second.check_disk_cache(KEY, CANDIDATES, _benchmark(second, runs)) is False
    third = tuner()
    assert third.check_disk_cache(KEY, CANDIDATES, _benchmark(third, runs)) is True and len(runs) == 2


def test_disabled_cache_always_tunes(tuner, monkeypatch, tmp_path):
    monkeypatch.setenv(tuning_cache.CACHE_DIR_ENV, "off")
    runs = []
    for _ in range(2):
        fresh = tuner()
        assert fresh.check_disk_cache(KEY, CANDIDATES, _benchmark(fresh, runs)) is False
    assert len(runs) == 2 and not list(tmp_path.iterdir())
