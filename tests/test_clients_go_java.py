"""The Go and Java example clients (clients/go, clients/java), built from the committed stubs with Debian's
toolchains, against a real Sluice server: streamed greedy tokens equal a direct transformers greedy loop,
the request aborted mid-stream and the one cancelled in-band on StreamGenerate end FINISH_REASON_ABORT and
free their KV blocks. A missing toolchain fails the test with the command that installs it."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
from service_harness import ServerThread
from sluice.v1 import sluice_pb2 as pb
from tokenizers import Tokenizer
from toolchains import REPO, require

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
LONG_TOKENS = 200  # the cancelled requests could run this long (max_model_len 256): they must not
LINE = re.compile(
    r"^(?P<kind>generate|abort|bidi): request_id=(?P<request_id>\S+) finish=(?P<finish>\S+) "
    r"tokens=(?P<tokens>\d+) text_bytes=(?P<text_bytes>\d+) token_ids=\[(?P<token_ids>[\d,]*)\] text="
)
CLIENTS = {
    # language: (programs it needs, the command that builds and runs the example)
    "go": (("go", "protoc-gen-go"), os.path.join(REPO, "clients", "go", "run_example.sh")),
    "java": (("javac", "java"), os.path.join(REPO, "clients", "java", "run_example.sh")),
}


@pytest.fixture(scope="module")
def reference(llama_dir: str) -> tuple[list[int], str]:
    """Greedy continuation by a plain argmax loop over transformers' forward, and its decoded text."""
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(os.path.join(llama_dir, "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(PROMPT).ids
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids + generated])).logits[0, -1]
            generated.append(int(logits.argmax()))
    return generated, tokenizer.decode(generated, skip_special_tokens=True)


def run_example(language: str, target: str) -> list[str]:
    programs, command = CLIENTS[language]
    require(*programs, "bash")
    args = [command, "--addr", target, "--prompt", PROMPT]
    args += ["--max-tokens", str(MAX_TOKENS), "--long-tokens", str(LONG_TOKENS)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, f"{language} example failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout.splitlines()


def parse(lines: list[str]) -> dict[str, dict[str, object]]:
    """request_id -> its fields, from the result lines."""
    results = {}
    for line in lines:
        if match := LINE.match(line):
            fields: dict[str, object] = match.groupdict()
            ids = str(fields["token_ids"])
            fields["token_ids"] = [int(t) for t in ids.split(",")] if ids else []
            fields["tokens"] = int(str(fields["tokens"]))
            fields["text_bytes"] = int(str(fields["text_bytes"]))
            results[str(fields["request_id"])] = fields
    return results


@pytest.mark.parametrize("language", ["go", "java"])
def test_example_streams_aborts_and_multiplexes(language: str, server: ServerThread, reference) -> None:
    expected_ids, expected_text = reference
    with server.channel() as channel:
        info = server.stub(channel).GetModelInfo(pb.GetModelInfoRequest())
    lines = run_example(language, server.target)
    assert lines[0] == f"model: name={info.model_name} max_model_len={info.max_model_len}"
    assert lines[-1] == "done"
    results = parse(lines)
    prefix = language
    assert sorted(results) == sorted(f"{prefix}-{name}" for name in ("generate", "abort", "bidi-0", "bidi-1"))

    for finished in (f"{prefix}-generate", f"{prefix}-bidi-0"):
        got = results[finished]
        assert got["finish"] == "FINISH_REASON_LENGTH", got
        assert got["token_ids"] == expected_ids, got
        assert got["text_bytes"] == len(expected_text.encode()) > 0, got

    for aborted in (f"{prefix}-abort", f"{prefix}-bidi-1"):
        got = results[aborted]
        assert got["finish"] == "FINISH_REASON_ABORT", got
        assert 1 <= got["tokens"] < LONG_TOKENS, got
        shared = min(got["tokens"], MAX_TOKENS)
        assert got["token_ids"][:shared] == expected_ids[:shared], got
    # The aborted and cancelled requests released every KV block.
    stats = server.wait_idle()
    assert stats.num_kv_blocks_used == 0


def test_go_and_java_examples_use_the_documented_service_config() -> None:
    """The service config in the Go and Java examples is the Python client's default, field for field."""
    import json
    from pathlib import Path

    from sluice.service_config import SERVICE_CONFIG

    go = Path(REPO, "clients", "go", "cmd", "sluice-example", "main.go").read_text()
    go_json = re.search(r"const serviceConfig = `(.*?)`", go, re.S).group(1)
    java_dir = Path(REPO, "clients", "java", "src", "main", "java", "ai", "sluice", "example")
    java = (java_dir / "SluiceExample.java").read_text()
    # Java builds the same config as a Map (no JSON parser among Debian's jars): every value is there.
    retry = SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]
    java_values = [
        '"round_robin", Map.of()',
        '"serviceName", "sluice.v1.InferenceService"',
        'Map.of("service", "sluice.v1.InferenceService")',
        f'"maxAttempts", {float(retry["maxAttempts"])}',
        f'"initialBackoff", "{retry["initialBackoff"]}"',
        f'"maxBackoff", "{retry["maxBackoff"]}"',
        f'"backoffMultiplier", {float(retry["backoffMultiplier"])}',
        '"retryableStatusCodes", List.of("UNAVAILABLE")',
    ]
    assert [v for v in java_values if v not in java] == []
    assert retry["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert json.loads(go_json) == SERVICE_CONFIG
    assert "grpc.WithDefaultServiceConfig(serviceConfig)" in go
    assert ".defaultServiceConfig(serviceConfig())" in java and ".enableRetry()" in java
