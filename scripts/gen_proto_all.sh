#!/usr/bin/env bash
# Regenerates the committed Python and Go stubs from proto/sluice/v1/sluice.proto. The Java stubs are not
# committed: clients/java/run_example.sh generates them into clients/java/build/ before compiling.
#
#   scripts/gen_proto_all.sh [OUT_ROOT]
#
# OUT_ROOT defaults to the repository root; scripts/check_proto.sh passes a temporary directory and
# diffs it against the committed code. Needs scripts/install_toolchains.sh (protoc, protoc-gen-go,
# protoc-gen-go-grpc) and the venv's grpcio-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT="${1:-.}"
PY="${PY:-.venv/bin/python}"
PROTO=sluice/v1/sluice.proto

python_out="$OUT_ROOT/clients/python"
go_out="$OUT_ROOT/clients/go"
mkdir -p "$python_out" "$go_out"

"$PY" -m grpc_tools.protoc -I proto \
    --python_out="$python_out" --grpc_python_out="$python_out" --pyi_out="$python_out" \
    "proto/$PROTO"

# go_package is github.com/sluice-ai/sluice/clients/go/sluice/v1: source_relative puts the files in
# clients/go/sluice/v1, which a GOPATH holding the repo as src/github.com/sluice-ai/sluice resolves.
protoc -I proto \
    --go_out="$go_out" --go_opt=paths=source_relative \
    --go-grpc_out="$go_out" --go-grpc_opt=paths=source_relative \
    "$PROTO"
