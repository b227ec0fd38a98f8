"""The package layering (docs/ARCHITECTURE.md, "Layers"): every import of the project's own code points
down or sideways-within-a-package, never up. Parsed from the source, so an import inside a function counts
as much as one at the top of a file."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lower rank = lower layer. A module may import its own package and packages of a lower rank only:
# conf imports no other package of the project; storage, kernels and data are independent of each other.
RANKS = {"conf": 0, "storage": 1, "kernels": 1, "data": 1, "model": 2, "offload": 3, "trainer": 4, "train": 5,
         "scripts": 5}


def project_modules() -> list[Path]:
    files = [ROOT / "train.py"]
    for package in RANKS:
        if (ROOT / package).is_dir():
            files += sorted((ROOT / package).rglob("*.py"))
    return files


def package_of(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level project package) of every absolute import in `path`; relative imports stay inside
    their own package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in RANKS]
    return found


def layering_violations(files: list[Path]) -> list[str]:
    violations = []
    for path in files:
        own = package_of(path)
        for line, target in imported_packages(path):
            if target != own and RANKS[target] >= RANKS[own]:
                violations.append(f"{path.relative_to(ROOT)}:{line} ({own}, layer {RANKS[own]}) imports "
                                  f"{target} (layer {RANKS[target]})")
    return violations


def test_no_import_points_up_or_across():
    assert layering_violations(project_modules()) == []


@pytest.mark.parametrize("source, importer, expected", [
    ("from trainer.loop import train\n", "offload/x.py", 1),      # upward
    ("import data\n", "kernels/x.py", 1),                         # across the bottom layer
    ("def f():\n    import model.llama\n", "conf/x.py", 1),       # inside a function counts
    ("from offload.plan import GIB\n", "trainer/x.py", 0),        # downward
    ("from .sibling import thing\n", "model/x.py", 0),            # relative: its own package
])
def test_the_check_catches_upward_imports(tmp_path, monkeypatch, source, importer, expected):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    path = tmp_path / importer
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert len(layering_violations([path])) == expected


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (a package's __init__ counts for `from package import name`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & modules


def import_cycles(files: list[Path]) -> list[list[str]]:
    """Each module that can reach itself through imports, with one such path."""
    modules = {module_name(path): path for path in files}
    graph = {name: module_imports(path, set(modules)) - {name} for name, path in modules.items()}
    cycles = []
    for start in sorted(graph):
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop()
            for target in sorted(graph[path[-1]]):
                if target == start:
                    cycles.append(path + [start])
                elif target not in seen:
                    seen.add(target)
                    paths.append(path + [target])
            if cycles and cycles[-1][0] == start:
                break
    return cycles


def test_model_modules_import_each_other_one_way():
    """model/llama.py loads checkpoints through model/hf_checkpoint.py, which never imports it back."""
    assert import_cycles(sorted((ROOT / "model").glob("*.py"))) == []
