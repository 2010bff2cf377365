#!/usr/bin/env bash
# Compiles the generated stubs and the Java example with javac against Debian's jars in /usr/share/java
# and runs it:
#   clients/java/run_example.sh --addr localhost:50051
# Classes go to clients/java/build/ (ignored by git).
set -euo pipefail
java_dir="$(cd "$(dirname "$0")" && pwd)"
build="$java_dir/build/classes"
jars=(grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub protobuf
      guava perfmark-api geronimo-annotation-1.3-spec
      netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-common netty-handler
      netty-handler-proxy netty-codec-socks netty-resolver netty-transport)
classpath="$(printf '/usr/share/java/%s.jar:' "${jars[@]}")"
mkdir -p "$build"
mapfile -t sources < <(find "$java_dir/src/main/java" -name '*.java')
javac -nowarn -encoding UTF-8 -d "$build" -cp "$classpath" "${sources[@]}"
java -cp "$build:$classpath" ai.sluice.example.SluiceExample "$@"
