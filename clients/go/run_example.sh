#!/usr/bin/env bash
# Builds the Go example in GOPATH mode against Debian's Go gRPC packages and runs it:
#   clients/go/run_example.sh --addr localhost:50051
# A throwaway GOPATH links the repository as github.com/sluice-ai/sluice (the proto's go_package);
# the binary and the build cache go to clients/go/build/ (ignored by git). Debian's grpc-go (1.33)
# applies the service config's retryPolicy only with GRPC_GO_RETRY=on (read before main runs).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
build="$repo/clients/go/build"
gopath="$(mktemp -d)"
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$build" "$gopath/src/github.com/sluice-ai"
ln -s "$repo" "$gopath/src/github.com/sluice-ai/sluice"
# Built beside the binary and renamed over it: two runs at once (e.g. two test processes) never run or
# write a half-written one.
GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOCACHE="$build/cache" \
    go build -o "$build/sluice-example.$$" github.com/sluice-ai/sluice/clients/go/cmd/sluice-example
mv -f "$build/sluice-example.$$" "$build/sluice-example"
GRPC_GO_RETRY=on "$build/sluice-example" "$@"
