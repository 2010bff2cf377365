#!/usr/bin/env bash
# Generates the Java stubs from proto/ (protoc with grpc_java_plugin, as a Maven or Gradle protobuf plugin
# would at build time; they are not committed), compiles them and the Java example with javac against
# Debian's jars in /usr/share/java, and runs it:
#   clients/java/run_example.sh --addr localhost:50051
# Generated sources and classes go to clients/java/build/ (ignored by git).
set -euo pipefail
java_dir="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$java_dir/../.." && pwd)"
build="$java_dir/build/classes"
generated="$java_dir/build/generated"
jars=(grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub protobuf
      guava perfmark-api geronimo-annotation-1.3-spec
      netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-common netty-handler
      netty-handler-proxy netty-codec-socks netty-resolver netty-transport)
# TLS: gRPC needs ALPN, and Debian's netty (4.1.48) dropped the JDK's (no JdkAlpnApplicationProtocolNegotiator;
# TLS fails "JDK provider does not support ALPN protocol"): its OpenSSL provider, netty-tcnative
# (libnetty-tcnative-java, libnetty-tcnative-jni), does ALPN instead. Netty loads it as libnetty_tcnative.so,
# which must be the file's own name (the library checks the path it was loaded from); Debian installs it as
# libnetty-tcnative.so, so a copy goes to build/native/. Maven's grpc-netty-shaded needs none of this.
tcnative_jar=/usr/share/java/netty-tcnative.jar
tcnative_so=/usr/lib/$(uname -m)-linux-gnu/jni/libnetty-tcnative.so
native="$java_dir/build/native"
if [ -e "$tcnative_jar" ] && [ -e "$tcnative_so" ]; then
    jars+=(netty-tcnative)
else
    for arg in "$@"; do
        if [[ "$arg" == --tls* ]]; then
            echo "run_example.sh: TLS needs netty-tcnative (Debian's netty has no JDK ALPN): install" \
                "libnetty-tcnative-java and libnetty-tcnative-jni (scripts/install_toolchains.sh)" >&2
            exit 1
        fi
    done
fi
classpath="$(printf '/usr/share/java/%s.jar:' "${jars[@]}")"
stamp="$java_dir/build/compiled.stamp"
proto="$repo/proto/sluice/v1/sluice.proto"
mkdir -p "$build"
# One build at a time (two runs at once, e.g. two test processes, each found no stamp, and one's rm -rf
# removed the classes the other compiled or ran): the lock is held until the build is done.
exec {lock}>"$java_dir/build/build.lock"
flock "$lock"
# Regenerate and recompile only when the proto or the example changed since the last build (javac on ~50
# generated classes takes a while).
if [ ! -e "$stamp" ] || [ "$proto" -nt "$stamp" ] \
    || [ -n "$(find "$java_dir/src/main/java" -name '*.java' -newer "$stamp")" ]; then
    rm -rf "$build" "$generated" && mkdir -p "$build" "$generated"
    protoc -I "$repo/proto" --plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin \
        --java_out="$generated" --grpc-java_out="$generated" "$proto"
    mapfile -t sources < <(find "$java_dir/src/main/java" "$generated" -name '*.java')
    # C1-only JIT: a short javac run finishes sooner without the optimizing compiler.
    javac -J-XX:TieredStopAtLevel=1 -nowarn -encoding UTF-8 -d "$build" -cp "$classpath" "${sources[@]}"
    touch "$stamp"
fi
if [ -e "$tcnative_so" ] && ! cmp -s "$tcnative_so" "$native/libnetty_tcnative.so"; then
    # Copied beside and renamed over: a run loading the library meanwhile never reads a half-written one.
    mkdir -p "$native" && cp "$tcnative_so" "$native/libnetty_tcnative.so.$$"
    mv -f "$native/libnetty_tcnative.so.$$" "$native/libnetty_tcnative.so"
fi
flock --unlock "$lock"
# Java decodes its arguments (--prompt) and encodes what it prints in the locale's charset: in the POSIX
# locale (a bare container's) that is ASCII, and every other character turns into '?'. The Go example takes
# and prints UTF-8 whatever the locale; so does this one, run in C.UTF-8 where the locale is not UTF-8.
if [ "$(locale charmap 2>/dev/null)" != "UTF-8" ]; then
    export LC_ALL=C.UTF-8
fi
java -XX:TieredStopAtLevel=1 -Djava.library.path="$native" -cp "$build:$classpath" \
    ai.sluice.example.SluiceExample "$@"
