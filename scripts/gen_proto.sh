#!/usr/bin/env bash
# Regenerates the committed Python stubs from proto/sluice/v1/sluice.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

"$PY" -m grpc_tools.protoc -I proto \
    --python_out=clients/python --grpc_python_out=clients/python --pyi_out=clients/python \
    proto/sluice/v1/sluice.proto
