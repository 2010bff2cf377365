"""`sluice generate` given an API key or a prompt grpc cannot send: one line naming it, exit status 2 (a
usage error, as argparse's), never a traceback; also for a key from an empty SLUICE_API_KEY."""

from __future__ import annotations

import pytest

from sluice.service.cli import main


@pytest.mark.parametrize(
    ("argv", "env_key", "message"),
    [
        (["--api-key", ""], None, "api_key: must be a non-empty string without surrounding whitespace"),
        ([], "", "api_key: must be a non-empty string without surrounding whitespace"),
        (["--api-key", "clé"], None, "api_key: must be printable ASCII (it is sent as a gRPC header value)"),
        (["--raw"], None, "text: '\\udcff' cannot be sent"),
    ],
    ids=["empty key", "empty SLUICE_API_KEY", "key not ASCII", "prompt not UTF-8"],
)
def test_sluice_generate_names_what_grpc_cannot_send_without_a_traceback(
    capsys, monkeypatch, argv: list[str], env_key: str | None, message: str
) -> None:
    """Each ended in the ValueError's traceback, exit status 1 (a prompt not UTF-8: argv bytes Python
    read with surrogateescape; without --raw, UnicodeEncodeError's). Nothing connects: no server."""
    if env_key is None:
        monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SLUICE_API_KEY", env_key)
    prompt = "\udcff" if "--raw" in argv else "hi"
    assert main(["generate", "--target", "127.0.0.1:1", *argv, prompt]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"sluice generate: {message}") and captured.err.count("\n") == 1
