"""The repository is installed (`make setup`: `pip install -e .`), so its packages import from any directory
and no script or test edits the interpreter's module search path to find them (pyproject.toml)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("conf", "data", "kernels", "model", "offload", "scripts", "storage", "trainer")
# Any use of the module search path, in code or in a child process's source held in a string.
PATH_EDIT = re.compile(r"\bsys\.path\b")


def python_files() -> list[Path]:
    """The project's packages, train.py and the tests but this file, whose examples below are such edits."""
    folders = (*PACKAGES, "tests")
    files = [ROOT / "train.py"] + [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    return [path for path in files if path != Path(__file__).resolve()]


def path_edits(files: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if PATH_EDIT.search(line)]


def test_no_script_or_test_edits_the_module_search_path():
    assert path_edits(python_files()) == []


@pytest.mark.parametrize("source, expected", [
    ("import sys\nsys.path.insert(0, '/repo')\n", 1),
    ("script = 'import sys; sys.path.append(\"/repo/tests\")'\n", 1),    # a child process's source
    ("from os import path\nprint(path.join('a', 'b'))\n", 0),
])
def test_the_check_catches_a_path_edit(tmp_path, monkeypatch, source, expected):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "x.py").write_text(source)
    assert len(path_edits([tmp_path / "x.py"])) == expected


def test_the_packages_import_from_a_clean_interpreter_outside_the_checkout(tmp_path):
    """A new interpreter in an empty directory, in the suite's environment: the packages come from `make setup`'s
    installation (on the GPU machine, whose image has none, from scripts/gpu_session.sh's PYTHONPATH)."""
    code = f"import {', '.join(PACKAGES)}; print('\\n'.join(m.__file__ for m in ({', '.join(PACKAGES)})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"run `make setup` in {ROOT}: {done.stderr[-2000:]}"
    where = [Path(file).parent for file in done.stdout.split()]
    assert where == [ROOT / package for package in PACKAGES], (
        f"this interpreter's installation is another checkout's ({where[0].parent}): run `make setup` in {ROOT}")


def test_a_script_runs_from_another_directory(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: export.py")
