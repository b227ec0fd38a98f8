"""The package layering (docs/ARCHITECTURE.md, "Layers"): every import of the project's own code points
down or sideways-within-a-package, never up; a subpackage (trainer/checkpoint/, kernels/attention/) is a layer inside
its package, below every module that uses it; and no module imports itself back through others (no import
cycle). Parsed from the source, so an import inside a function counts as much as one at the top of a file."""
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


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules (dotted names in `known`) that `path` imports: `from a.b import c` names the module
    a.b.c when there is one, else a.b; relative imports are resolved against path's package."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + [base] * bool(base))
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        found |= {next(name for name in names if name in known) for names in candidates
                  if any(name in known for name in names)}
    return found - {own}


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    known = {module_name(path) for path in files}
    return {module_name(path): imported_modules(path, known) for path in files}


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module that `start`'s modules import, directly or through others."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b -> a' for every module that imports itself back through others (each cycle once per module)."""
    cycles = []
    for module, targets in graph.items():
        for target in sorted(targets):
            if module in reachable(graph, {target}):
                cycles.append(f"{module} -> {target} -> ... -> {module}")
    return cycles


def subpackages(files: list[Path]) -> set[str]:
    """Packages inside a top-level package (trainer.checkpoint), by their __init__.py."""
    return {module_name(path) for path in files if path.name == "__init__.py" and module_name(path).count(".") >= 1}


def subpackage_violations(graph: dict[str, set[str]], subpackage: str) -> list[str]:
    """The rule for a subpackage: of its parent package it may import only modules that do not use it,
    directly or through others; so trainer/checkpoint/ never reaches up into the loop, the build or anything
    else that stands on it."""
    inside = {module for module in graph if module == subpackage or module.startswith(subpackage + ".")}
    parent = subpackage.rpartition(".")[0]
    users = {module for module in graph if module not in inside and reachable(graph, graph[module]) & inside}
    return [f"{module} (in {subpackage}/) imports {target}, which uses {subpackage}"
            for module in sorted(inside) for target in sorted(graph[module] - inside)
            if target.startswith(parent + ".") and target in users]


def test_no_import_cycle():
    """E.g. model/decoder.py loads checkpoints through model/hf_checkpoint.py, which never imports it back."""
    assert import_cycles(import_graph(project_modules())) == []


def test_a_subpackage_imports_nothing_of_its_package_that_uses_it():
    graph = import_graph(project_modules())
    assert "trainer.checkpoint" in subpackages(project_modules())
    assert [problem for subpackage in subpackages(project_modules())
            for problem in subpackage_violations(graph, subpackage)] == []


@pytest.mark.parametrize("source, importer, expected", [
    ("from trainer.loop import train\n", "offload/x.py", 1),      # upward
    ("import data\n", "kernels/x.py", 1),                         # across the bottom layer
    ("def f():\n    import model.decoder\n", "conf/x.py", 1),       # inside a function counts
    ("from offload.plan import GIB\n", "trainer/x.py", 0),        # downward
    ("from trainer.build import Built\n", "kernels/attention/x.py", 1),   # from a subpackage, upward
    ("from data import Batch\n", "kernels/attention/x.py", 1),           # from a subpackage, across
    ("from .sibling import thing\n", "model/x.py", 0),            # relative: its own package
])
def test_the_check_catches_upward_imports(tmp_path, monkeypatch, source, importer, expected):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    path = tmp_path / importer
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert len(layering_violations([path])) == expected


def write_modules(root: Path, sources: dict[str, str]) -> list[Path]:
    for name, source in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return [root / name for name in sources]


@pytest.mark.parametrize("sources, expected", [
    ({"trainer/a.py": "from trainer.b import x\n", "trainer/b.py": "def f():\n    import trainer.a\n"}, 2),
    ({"trainer/a.py": "from trainer import b\n", "trainer/b.py": "from .c import y\n",
      "trainer/c.py": "import trainer.a\n"}, 3),
    ({"trainer/a.py": "from trainer.b import x\n", "trainer/b.py": "import trainer.c\n", "trainer/c.py": ""}, 0),
])
def test_the_check_catches_import_cycles(tmp_path, monkeypatch, sources, expected):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert len(import_cycles(import_graph(write_modules(tmp_path, sources)))) == expected


@pytest.mark.parametrize("checkpoint_imports, expected", [
    ("from trainer.loop import run\n", 1),          # up: the loop uses the subpackage
    ("from trainer.console import say\n", 1),       # up through another module: console imports the loop
    ("from trainer.metrics import log\n", 0),       # below it
    ("from .format import Progress\n", 0),          # its own subpackage
])
def test_the_check_catches_a_subpackage_reaching_up(tmp_path, monkeypatch, checkpoint_imports, expected):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    files = write_modules(tmp_path, {
        "trainer/__init__.py": "", "trainer/metrics.py": "", "trainer/console.py": "import trainer.loop\n",
        "trainer/loop.py": "from trainer.checkpoint.manager import Manager\n",
        "trainer/checkpoint/__init__.py": "", "trainer/checkpoint/format.py": "",
        "trainer/checkpoint/manager.py": checkpoint_imports})
    assert subpackages(files) == {"trainer.checkpoint"}
    assert len(subpackage_violations(import_graph(files), "trainer.checkpoint")) == expected
