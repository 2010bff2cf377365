#!/usr/bin/env bash
# Proto hygiene: buf lint (STANDARD), buf breaking against the last released API, and the committed
# Python / Go / Java stubs being exactly what scripts/gen_proto_all.sh makes from proto/ now.
#
# The released API is the image proto/released/sluice_v1.binpb. Cutting a release refreshes it:
#   .tools/node_modules/.bin/buf build proto -o proto/released/sluice_v1.binpb
# BUF and PY may point at other binaries; by default they come from scripts/install_toolchains.sh
# (.tools/) and the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF="${BUF:-.tools/node_modules/.bin/buf}"
export PY="${PY:-.venv/bin/python}"

if [ ! -x "$BUF" ] || ! command -v protoc >/dev/null; then
    echo "check_proto: buf or protoc missing; run scripts/install_toolchains.sh" >&2
    exit 2
fi

"$BUF" lint proto
echo "check_proto: buf lint ok"
"$BUF" breaking proto --against proto/released/sluice_v1.binpb
echo "check_proto: buf breaking ok (against proto/released/sluice_v1.binpb)"

fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
scripts/gen_proto_all.sh "$fresh"
stale=0
# committed directory : its freshly generated twin (only generated files live in these directories)
for dir in clients/python/sluice/v1 clients/go/sluice/v1; do
    if ! diff -r -q --exclude=__init__.py --exclude=__pycache__ "$fresh/$dir" "$dir"; then
        stale=1
    fi
done
if [ "$stale" -ne 0 ]; then
    echo "check_proto: generated code is out of date with proto/; run 'make proto' and commit the result" >&2
    exit 1
fi
echo "check_proto: generated code up to date"
