#!/usr/bin/env bash
# Regenerates the committed Python, Go and Java stubs from proto/sluice/v1/sluice.proto.
#
#   scripts/gen_proto_all.sh [OUT_ROOT]
#
# OUT_ROOT defaults to the repository root; scripts/check_proto.sh passes a temporary directory and
# diffs it against the committed code. Needs scripts/install_toolchains.sh (protoc, protoc-gen-go,
# protoc-gen-go-grpc, grpc_java_plugin) and the venv's grpcio-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT="${1:-.}"
PY="${PY:-.venv/bin/python}"
PROTO=sluice/v1/sluice.proto

python_out="$OUT_ROOT/clients/python"
server_out="$OUT_ROOT/service/stubs"
go_out="$OUT_ROOT/clients/go"
java_out="$OUT_ROOT/clients/java/src/main/java"
mkdir -p "$python_out" "$server_out" "$go_out" "$java_out"

"$PY" -m grpc_tools.protoc -I proto \
    --python_out="$python_out" --grpc_python_out="$python_out" --pyi_out="$python_out" \
    "proto/$PROTO"

# The server's own copy of the Python messages and service base (it does not depend on the client
# package): the same generated code, its one import pointed at service.stubs.
cp "$python_out/sluice/v1/sluice_pb2.py" "$server_out/sluice_pb2.py"
sed 's/^from sluice\.v1 import sluice_pb2 as /from service.stubs import sluice_pb2 as /' \
    "$python_out/sluice/v1/sluice_pb2_grpc.py" >"$server_out/sluice_pb2_grpc.py"

# go_package is github.com/sluice-ai/sluice/clients/go/sluice/v1: source_relative puts the files in
# clients/go/sluice/v1, which a GOPATH holding the repo as src/github.com/sluice-ai/sluice resolves.
protoc -I proto \
    --go_out="$go_out" --go_opt=paths=source_relative \
    --go-grpc_out="$go_out" --go-grpc_opt=paths=source_relative \
    "$PROTO"

protoc -I proto \
    --plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin \
    --java_out="$java_out" --grpc-java_out="$java_out" \
    "$PROTO"
