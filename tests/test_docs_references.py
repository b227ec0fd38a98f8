"""What the docs point to exists: the files README.md and docs/PERFORMANCE.md name, the experiment patches kept
in docs/experiments/ (each must still apply to the tree, or go: its result stays in PERFORMANCE.md and git),
and no reference to the retired docs/BENCHMARKS.md but through git history."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A repository path as the docs write one: a top-level folder of the project, then lower-case names.
NAMED_PATH = re.compile(r"\b((?:conf|data|docs|kernels|model|offload|scripts|storage|tests|trainer)/[a-z0-9_/.-]*"
                        r"[a-z0-9_]\.(?:py|sh|md|png|patch|yaml))\b")
# How a file may still name the notebook: as a git object of the commit before it went, or a git log of it.
HISTORY = re.compile(r"c729dfe:docs/BENCHMARKS\.md|-- docs/BENCHMARKS\.md")


def named_paths(text: str) -> set[str]:
    return set(NAMED_PATH.findall(text))


def test_the_pattern_finds_paths_and_leaves_placeholders():
    text = "see `scripts/experiments/forward_ab.py`, docs/experiments/NAME.patch and c729dfe:docs/BENCHMARKS.md"
    assert named_paths(text) == {"scripts/experiments/forward_ab.py"}


@pytest.mark.parametrize("doc", ["README.md", "docs/PERFORMANCE.md"])
def test_every_file_a_doc_names_exists(doc):
    missing = sorted(path for path in named_paths((ROOT / doc).read_text()) if not (ROOT / path).exists())
    assert missing == [], f"{doc} names files that do not exist: {missing}"


def test_kept_experiment_patches_apply_to_the_tree():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    patches = sorted((ROOT / "docs" / "experiments").glob("*.patch"))
    stale = [patch.name for patch in patches
             if subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True).returncode]
    assert stale == [], f"no longer apply (remove them; PERFORMANCE.md keeps their results): {stale}"


def test_nothing_names_the_retired_benchmarks_notebook_but_through_git():
    files = [path for pattern in ("*.py", "*.md", "*.sh", "*.patch") for path in ROOT.rglob(pattern)
             if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)]
    naming = [str(path.relative_to(ROOT)) for path in files
              if "BENCHMARKS.md" in HISTORY.sub("", path.read_text(errors="replace"))
              and path != Path(__file__).resolve()]
    assert naming == [], f"name docs/BENCHMARKS.md (gone: point to docs/PERFORMANCE.md): {naming}"
