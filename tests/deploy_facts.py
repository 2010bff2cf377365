"""What the deploy/ files must agree with: the `sluice serve` command line and the metrics it exports."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.engine.outputs import EngineStats
from sluice.service.cli import build_parser, load_commands
from sluice.service.metrics import ServerMetrics


def parse_sluice_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses a container's `sluice ...` arguments with the real CLI parser (SystemExit on a bad flag)."""
    return build_parser(load_commands()).parse_args(list(argv))


def exported_sample_names() -> set[str]:
    """Every sample name a server's /metrics shows once the engine runs (`_total`, `_bucket`... included)."""
    stats = EngineStats(
        num_running=1,
        num_waiting=2,
        num_kv_blocks_total=10,
        num_kv_blocks_used=3,
        num_preemptions=0,
        num_prompt_tokens_computed=5,
        num_generation_tokens=7,
    )
    metrics = ServerMetrics(lambda: stats)
    # Label values appear only once used: touch every labelled metric.
    metrics.requests.labels(finish_reason="length", tenant="default").inc()
    for counter in (metrics.prompt_tokens, metrics.generation_tokens, metrics.cached_tokens):
        counter.labels(tenant="default").inc()
    metrics.tenant_rejections.labels(tenant="default").inc()
    metrics.rpc_status.labels(method="Generate", code="OK").inc()
    text = generate_latest(metrics.registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
