#!/usr/bin/env bash
# Installs what the Go and Java client examples and the proto checks need: Go, Java and protoc
# toolchains from Debian packages, and buf from npm into .tools/ (ignored by git).
# Idempotent: when everything is present it only checks, in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

BUF_VERSION="${BUF_VERSION:-1.75.0}"
TOOLS_DIR=".tools"

# Debian 12 packages: Go (GOPATH-mode libraries under /usr/share/gocode), protoc and its Go/Java plugins,
# and the jars the Java example compiles and runs against (/usr/share/java).
APT_PACKAGES=(
    golang-go
    protoc-gen-go
    protoc-gen-go-grpc
    golang-google-grpc-dev
    golang-google-protobuf-dev
    # github.com/golang/protobuf 1.5 (a shim over APIv2) for grpc-go 1.33; golang-goprotobuf-dev would
    # pull protoc-gen-go-1-3, which conflicts with protoc-gen-go and cannot handle proto3 optional.
    golang-github-golang-protobuf-1-5-dev
    protobuf-compiler
    protobuf-compiler-grpc-java-plugin
    libgrpc-java
    libprotobuf-java
    libgeronimo-annotation-1.3-spec-java
    libguava-java
    libnetty-java
    # netty's OpenSSL provider: the Java example's TLS (Debian's netty has no JDK ALPN; run_example.sh)
    libnetty-tcnative-java
    libnetty-tcnative-jni
    libperfmark-java
    default-jdk-headless
)

missing_apt_packages() {
    local pkg
    for pkg in "${APT_PACKAGES[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            echo "$pkg"
        fi
    done
}

apt_install() {
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
        echo "install_toolchains: need root to install: $*" >&2
        exit 1
    fi
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "install_toolchains: apt-get install $*"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_apt_packages() {
    local missing
    missing="$(missing_apt_packages)"
    [ -z "$missing" ] && return 0
    # shellcheck disable=SC2086
    apt_install $missing
}

install_buf() {
    local buf="$TOOLS_DIR/node_modules/.bin/buf"
    if [ -x "$buf" ] && [ "$("$buf" --version 2>/dev/null)" = "$BUF_VERSION" ]; then
        return 0
    fi
    # Debian's npm only where there is no npm at all: a NodeSource nodejs carries its own and conflicts with it.
    command -v npm >/dev/null || apt_install npm
    echo "install_toolchains: npm install @bufbuild/buf@$BUF_VERSION into $TOOLS_DIR/"
    mkdir -p "$TOOLS_DIR"
    npm install --silent --no-audit --no-fund --prefix "$TOOLS_DIR" "@bufbuild/buf@$BUF_VERSION" >/dev/null
}

install_apt_packages
install_buf
echo "install_toolchains: go, javac, protoc, grpc_java_plugin and $TOOLS_DIR/node_modules/.bin/buf ready"
