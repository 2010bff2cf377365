"""An OTEL_* export setting the OpenTelemetry SDK cannot use is refused by `sluice serve` in one line naming
the variable (exit code 2). Found by an operations probe: a compression other than gzip/deflate/none ended
in a traceback (InvalidCompressionValueException), and a bad timeout or span-processor size in the SDK's
message, which names no variable ("could not convert string to float: 'abc'", "max_queue_size must be a
positive integer." read as if it were about --max-queue); a span-processor integer that did not parse was
logged with a traceback and ignored."""

from __future__ import annotations

import pytest

from sluice.service import serve_command
from sluice.service.cli import build_parser, load_commands
from sluice.service.tracing import tracer_provider_from_env


async def _served(*args: object) -> int:
    """In place of `serve_command.serve`: a setting let through serves nothing (the test fails on 0)."""
    return 0


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "must be one of gzip, deflate, none, got 'zstd'"),
        ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "br", "must be one of gzip, deflate, none, got 'br'"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", "must be a number of seconds > 0, got 'abc'"),
        ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-1", "must be a number of seconds > 0, got '-1'"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "-1", "must be an integer > 0, got '-1'"),
        ("OTEL_BSP_SCHEDULE_DELAY", "5s", "must be an integer > 0, got '5s'"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096", "must be <= OTEL_BSP_MAX_QUEUE_SIZE"),
    ],
)
def test_a_bad_export_setting_is_one_line_naming_the_variable(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    message: str,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(serve_command, "serve", _served)
    args = build_parser(load_commands(["serve"])).parse_args(["serve", "--preset", "tiny"])
    assert serve_command.run(args) == 2
    assert capsys.readouterr().err == f"sluice serve: {variable}: {message}\n"


def test_good_export_settings_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": " GZIP",
        "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
    }
    for variable, value in settings.items():
        monkeypatch.setenv(variable, value)
    provider = tracer_provider_from_env()
    assert provider is not None
    provider.shutdown()


def test_export_settings_are_not_read_while_tracing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "-1")
    assert tracer_provider_from_env() is None


def test_nothing_else_is_read_while_the_sdk_is_disabled() -> None:
    """OTEL_SDK_DISABLED=true turns tracing off (docs/OPERATIONS.md); an exporter Sluice does not serve
    beside it stopped the server."""
    for extra in ({"OTEL_TRACES_EXPORTER": "console"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}):
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
        environ = {"OTEL_SDK_DISABLED": "true", **endpoint, **extra}
        assert tracer_provider_from_env(environ) is None
