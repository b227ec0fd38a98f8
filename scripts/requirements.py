"""Print pyproject.toml's runtime and dev dependencies, one per line, for `pip install -r`."""
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
