# `make train` and `make test` set everything up on a fresh machine (idempotently) and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Without a GPU take the CPU build of torch that lies on disk, and the Triton the GPU image uses (its
# interpreter runs the kernel tests on CPU); with one, the default CUDA build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0 triton==3.6.0)

.PHONY: setup train test clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) scripts/requirements.py > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

train: setup
	$(PY) train.py $(ARGS)

# Two pytest-xdist workers: most tests run on one core (Triton's interpreter, one-thread training jobs); an idle
# worker takes tests queued for the other (worksteal), so a long test late in one queue does not end the run alone.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist worksteal tests

clean:
	rm -rf $(VENV)
