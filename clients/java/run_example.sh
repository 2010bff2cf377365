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
stamp="$java_dir/build/compiled.stamp"
mkdir -p "$build"
# Recompile only when a source changed since the last build (javac on ~50 stubs takes a while).
if [ ! -e "$stamp" ] || [ -n "$(find "$java_dir/src/main/java" -name '*.java' -newer "$stamp")" ]; then
    mapfile -t sources < <(find "$java_dir/src/main/java" -name '*.java')
    rm -rf "$build" && mkdir -p "$build"
    # C1-only JIT: a short javac run finishes sooner without the optimizing compiler.
    javac -J-XX:TieredStopAtLevel=1 -nowarn -encoding UTF-8 -d "$build" -cp "$classpath" "${sources[@]}"
    touch "$stamp"
fi
java -XX:TieredStopAtLevel=1 -cp "$build:$classpath" ai.sluice.example.SluiceExample "$@"
