"""The text the Go and Java examples send and print. A stand-in server streams each prompt back one character
per chunk (so every multi-byte character arrives in a chunk of its own).

- UTF-8 whatever the caller's locale. Under the POSIX locale (a bare container's: no LANG), Java decoded its
  arguments and encoded its output as ASCII: the prompt "café 🦊" reached the server as "caf\ufffd\ufffd
  \ufffd..." and the text printed as "caf?? ????"; the Go example took and printed UTF-8 bytes.
- One line per result, as the examples' docs say: Go prints the text with %q; Java escaped only "\n", so a
  generated "\r" (or U+2028, or another control character) split its result over lines, and a quote in the
  text ended the quoted field early."""

from __future__ import annotations

import os
import subprocess

import pytest
from test_clients_go_java import CLIENTS, parse, stand_in_server
from toolchains import require

from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc

PROMPT = "café 🦊 ü 日本"


class _Echo(sluice_pb2_grpc.InferenceServiceServicer):
    """Streams a text prompt back one character (one "token", its code point) per chunk."""

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model_name="echo", max_model_len=64)

    def _chunks(self, request: pb.GenerateRequest):
        for i, char in enumerate(request.text):
            last = i == len(request.text) - 1
            finish = pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(
                request_id=request.request_id, text=char, token_ids=[ord(char)], finish_reason=finish
            )

    def Generate(self, request, context):
        yield from self._chunks(request)

    def Abort(self, request, context):
        return pb.AbortResponse()

    def StreamGenerate(self, request_iterator, context):
        for action in request_iterator:
            if action.HasField("generate"):
                for chunk in self._chunks(action.generate):
                    yield pb.StreamGenerateResponse(request_id=chunk.request_id, chunk=chunk)


@pytest.mark.parametrize("language", ["go", "java"])
def test_example_sends_and_prints_utf8_in_the_posix_locale(language: str) -> None:
    lines = _run_against_echo(language, PROMPT, {"LC_ALL": "C"})
    results = parse(lines)
    assert len(results) == 4, lines
    for request_id, got in results.items():
        assert got["token_ids"] == [ord(char) for char in PROMPT], (request_id, got)
        assert got["text_bytes"] == len(PROMPT.encode()), (request_id, got)
    assert all(line.endswith(f'text="{PROMPT}"') for line in lines if parse([line])), lines


@pytest.mark.parametrize("language", ["go", "java"])
def test_example_prints_each_result_on_one_line(language: str) -> None:
    """Split as Python's universal newlines split (\\r, \\x1c, U+2028 too), as `text=True` reads it."""
    lines = _run_against_echo(language, 'a\rb\x1cc"d\\e\u2028f\tg', {})
    assert len(lines) == 6 and lines[-1] == "done", lines
    results = parse(lines)
    assert len(results) == 4, lines
    # Go's %q of the text.
    assert all(line.endswith('text="a\\rb\\x1cc\\"d\\\\e\\u2028f\\tg"') for line in lines[1:-1]), lines


def _run_against_echo(language: str, prompt: str, locale: dict[str, str]) -> list[str]:
    """The example's output lines, run against an _Echo stand-in with `locale` in place of the caller's."""
    programs, command = CLIENTS[language]
    require(*programs, "bash")
    env = dict(os.environ)
    if locale:
        env = {key: value for key, value in env.items() if not key.startswith(("LANG", "LC_"))} | locale
    with stand_in_server(_Echo()) as target:
        args = [command, "--addr", target, "--prompt", prompt, "--max-tokens", "8"]
        result = subprocess.run(
            [*args, "--long-tokens", str(len(prompt))], capture_output=True, env=env, timeout=540, check=False
        )
    stdout = result.stdout.decode("utf-8", errors="replace")
    assert result.returncode == 0, f"{stdout}\n{result.stderr.decode(errors='replace')}"
    return stdout.splitlines()
