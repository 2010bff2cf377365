"""Proto hygiene through scripts/check_proto.sh: buf lint, buf breaking against the released API, and the
committed Python and Go stubs matching the proto (the Java stubs are
generated at build time, tests/test_clients_go_java.py). Each failure mode is provoked in a scratch copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from toolchains import BUF, REPO, require

PROTO = os.path.join("proto", "sluice", "v1", "sluice.proto")
# What check_proto.sh reads: the proto module, its scripts, and the generated directories it compares.
COPIED = (
    "proto",
    "scripts",
    "clients/python/sluice/v1",
    "clients/go/sluice/v1",
)


def run_check(root: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, BUF=BUF, PY=sys.executable)
    return subprocess.run(
        [os.path.join(root, "scripts", "check_proto.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture
def scratch(tmp_path) -> str:
    """A copy of the repository parts check_proto.sh reads, safe to break."""
    require("buf", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
    for part in COPIED:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(os.path.join(REPO, part), tmp_path / part, ignore=ignore)
    return str(tmp_path)


def edit_proto(root: str, old: str, new: str) -> None:
    path = os.path.join(root, PROTO)
    with open(path) as f:
        text = f.read()
    assert text.count(old) == 1, old
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def test_check_proto_passes_on_the_repository() -> None:
    require("buf", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
    result = run_check(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "check_proto: buf lint ok",
        "check_proto: buf breaking ok (against proto/released/sluice_v1.binpb)",
        "check_proto: generated code up to date",
    ]


def test_stale_generated_code_fails(scratch: str) -> None:
    # An additive field: lint and breaking pass, but the committed stubs of both languages are now stale.
    edit_proto(scratch, "message AbortResponse {}", "message AbortResponse {\n  bool aborted = 1;\n}")
    result = run_check(scratch)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "check_proto: buf breaking ok" in result.stdout
    assert "generated code is out of date with proto/; run 'make proto'" in result.stderr
    for stale in ("sluice_pb2.py", "sluice_pb2.pyi", "sluice.pb.go"):
        assert stale in result.stdout, f"{stale} not reported in:\n{result.stdout}"


def test_deleted_generated_file_fails(scratch: str) -> None:
    os.remove(os.path.join(scratch, "clients/go/sluice/v1/sluice_grpc.pb.go"))
    result = run_check(scratch)
    assert result.returncode == 1
    assert "Only in" in result.stdout and "sluice_grpc.pb.go" in result.stdout


def test_breaking_change_against_the_release_fails(scratch: str) -> None:
    # Renumbering a field breaks the wire format of every released client.
    edit_proto(
        scratch,
        "message AbortRequest {\n  string request_id = 1;",
        "message AbortRequest {\n  string request_id = 2;",
    )
    result = run_check(scratch)
    assert result.returncode != 0
    assert "buf lint ok" in result.stdout and "buf breaking ok" not in result.stdout
    expected = 'Previously present field "1" with name "request_id" on message "AbortRequest" was deleted.'
    assert expected in result.stdout


def test_lint_violation_fails(scratch: str) -> None:
    edit_proto(scratch, "message AbortResponse {}", "message AbortResponse {}\n\nmessage abort_detail {}")
    result = run_check(scratch)
    assert result.returncode != 0
    assert "buf lint ok" not in result.stdout
    assert 'Message name "abort_detail" should be PascalCase, such as "AbortDetail".' in result.stdout
