"""deploy/observability: the compose stack's files parse, point at each other, and the Grafana dashboard
queries only metric names the server really exports."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import yaml
from deploy_facts import exported_sample_names, parse_sluice_args
from toolchains import REPO

STACK = os.path.join(REPO, "deploy", "observability")
DASHBOARD = os.path.join(STACK, "grafana", "dashboards", "sluice.json")
METRIC_NAME = re.compile(r"\bsluice_[a-z0-9_]+\b")


def load_yaml(name: str) -> dict[str, Any]:
    with open(os.path.join(STACK, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml("docker-compose.yaml")


@pytest.fixture(scope="module")
def sluice_args(compose):
    return parse_sluice_args(compose["services"]["sluice"]["command"])


def test_compose_services_and_mounted_files(compose) -> None:
    services = compose["services"]
    assert sorted(services) == ["grafana", "otel-collector", "prometheus", "sluice"]
    for name, service in services.items():
        assert "image" in service, name
        for volume in service.get("volumes", []):
            if isinstance(volume, str):  # short syntax ./host:/container:ro
                source = volume.split(":")[0]
                assert volume.endswith(":ro"), volume
                assert os.path.exists(os.path.join(STACK, source)), volume
    build = services["sluice"]["build"]
    assert os.path.isfile(os.path.join(STACK, build["context"], build["dockerfile"]))
    (model,) = services["sluice"]["volumes"]
    assert (model["target"], model["read_only"]) == ("/models", True)


def test_compose_gpu_override_reserves_nvidia_devices() -> None:
    override = load_yaml("docker-compose.gpu.yaml")
    (device,) = override["services"]["sluice"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_sluice_exports_traces_to_the_collector_receiver(compose) -> None:
    collector = load_yaml("otel-collector.yaml")
    port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    environment = compose["services"]["sluice"]["environment"]
    assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{port}"
    assert environment["OTEL_TRACES_EXPORTER"] == "otlp"
    assert compose["services"]["otel-collector"]["ports"] == [f"{port}:{port}"]
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(collector[kind]), kind
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def test_prometheus_scrapes_the_metrics_port(sluice_args) -> None:
    prometheus = load_yaml("prometheus.yml")
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"sluice:{sluice_args.metrics_port}"]}]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose) -> None:
    (datasource,) = load_yaml("grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert (
        datasource["url"] == "http://prometheus:9090"
        and "9090:9090" in compose["services"]["prometheus"]["ports"]
    )
    (provider,) = load_yaml("grafana/provisioning/dashboards/sluice.yaml")["providers"]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]


def test_dashboard_panels_query_exported_metrics() -> None:
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert titles == [
        "Time to first token",
        "Inter-token latency",
        "Throughput",
        "KV cache usage",
        "Prefix cache hits",
        "Requests",
    ]
    exported = exported_sample_names()
    queried = set()
    for panel in dashboard["panels"]:
        exprs = [target["expr"] for target in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            names = set(METRIC_NAME.findall(expr))
            assert names, expr
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} not exported"
            queried |= names
    for required in (
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_inter_token_latency_seconds_bucket",
        "sluice_generation_tokens_total",
        "sluice_kv_cache_usage_ratio",
        "sluice_prefix_cache_hits_total",
    ):
        assert required in queried, required
