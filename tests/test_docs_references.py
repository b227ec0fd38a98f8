"""What the docs point to exists: the files README.md, docs/PERFORMANCE.md and docs/ARCHITECTURE.md name, and the
code objects docs/ARCHITECTURE.md names; docs/experiments/ keeps no patch (a try not kept stays in git, named
with its commit in PERFORMANCE.md); PERFORMANCE.md holds current figures only, within its bound; and no
reference to the retired docs/BENCHMARKS.md but through git history."""
import re
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


@pytest.mark.parametrize("doc", ["README.md", "docs/PERFORMANCE.md", "docs/ARCHITECTURE.md"])
def test_every_file_a_doc_names_exists(doc):
    missing = sorted(path for path in named_paths((ROOT / doc).read_text()) if not (ROOT / path).exists())
    assert missing == [], f"{doc} names files that do not exist: {missing}"


def test_no_experiment_patch_is_kept_in_the_tree():
    """A patch kept beside the code goes stale as the code moves; git keeps it at the commit PERFORMANCE.md's
    "Tried and not kept" names."""
    assert sorted((ROOT / "docs" / "experiments").glob("*.patch")) == []


# PERFORMANCE.md holds the current figures only (superseded ones are in git); a change adding rows replaces
# the ones it supersedes.
PERFORMANCE_MAX_LINES = 400


def test_performance_md_stays_within_its_bound():
    lines = len((ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines())
    assert lines <= PERFORMANCE_MAX_LINES, f"docs/PERFORMANCE.md has {lines} lines: remove superseded figures"


# A code name as ARCHITECTURE.md writes one, in backticks: dotted identifiers, perhaps with a call's arguments.
CODE_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\([^`]*\))?`")
# Names of torch and Triton it mentions, defined outside the project.
EXTERNAL = {"GPUTarget", "record_stream", "scaled_dot_product_attention"}


def code_like(part: str) -> bool:
    """A class (CamelCase) or a function, method or attribute with an underscore; not an environment variable
    or a plain word (`attention`, `host`), which prose uses as words too."""
    return not part.isupper() and ("_" in part.strip("_") or part[0].isupper())


def test_every_code_object_architecture_md_names_exists():
    sources = [path for path in ROOT.rglob("*.py") if not any(p.startswith(".") for p in path.relative_to(ROOT).parts)]
    code = "\n".join(path.read_text() for path in sources)
    defined = ({path.stem for path in sources} | set(re.findall(r"\b(?:def|class)\s+(\w+)", code))
               | set(re.findall(r"^\s*(?:self\.)?(\w+)\s*(?::[^=\n]*)?=", code, re.MULTILINE))
               | set(re.findall(r"^\s*(\w+)\s*:", code, re.MULTILINE)) | set(re.findall(r"[\"'](\w+)[\"']", code)))
    names = [name for name in CODE_NAME.findall((ROOT / "docs" / "ARCHITECTURE.md").read_text())
             if name.split(".")[0] not in ("torch", "nn", "F") and name.rpartition(".")[2] not in ("py", "md")]
    missing = sorted({part for name in names for part in name.split(".")
                      if code_like(part) and part not in defined and part not in EXTERNAL})
    assert missing == [], f"docs/ARCHITECTURE.md names code objects that do not exist: {missing}"


def test_nothing_names_the_retired_benchmarks_notebook_but_through_git():
    files = [path for pattern in ("*.py", "*.md", "*.sh", "*.patch") for path in ROOT.rglob(pattern)
             if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)]
    naming = [str(path.relative_to(ROOT)) for path in files
              if "BENCHMARKS.md" in HISTORY.sub("", path.read_text(errors="replace"))
              and path != Path(__file__).resolve()]
    assert naming == [], f"name docs/BENCHMARKS.md (gone: point to docs/PERFORMANCE.md): {naming}"
