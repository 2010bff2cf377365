"""deploy/k8s: --max-connection-age sends each connection a GOAWAY every ~300 s so clients re-resolve the
headless Service; the calls in flight on it get --max-connection-age-grace, then grpc closes the connection
and every call still open ends UNAVAILABLE mid-stream ("max connection age"), tokens already sent, so no
client or gateway retries it. SMG holds one connection per pod for all the calls it routes there, so a
grace shorter than a generation loses every longer request caught by a GOAWAY: the grace must outlast any
request the gateway still waits for (its --request-timeout-secs). A drain is not lengthened by it: the
server's stop(grace) cuts what is left after --grace-period (test_deploy: terminationGracePeriodSeconds)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from deploy_facts import parse_sluice_args
from kustomize_render import render
from smg.launch_router import parse_router_args
from toolchains import REPO

OVERLAY = os.path.join(REPO, "deploy", "k8s", "overlays", "fleet")


@pytest.fixture(scope="module")
def containers() -> dict[str, dict[str, Any]]:
    deployments = [doc for doc in render(OVERLAY) if doc["kind"] == "Deployment"]
    found = {}
    for deployment in deployments:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        found[deployment["metadata"]["name"]] = container
    return found


def test_aged_connections_outlive_the_gateways_requests(containers) -> None:
    sluice = parse_sluice_args(containers["sluice"]["args"])
    smg_args = containers["smg"]["args"]
    assert smg_args[0] == "launch"
    smg = parse_router_args([arg.replace("$(POD_NAMESPACE)", "default") for arg in smg_args[1:]])
    assert sluice.max_connection_age > 0  # the GOAWAYs that let clients find new pods stay
    assert sluice.max_connection_age_grace >= smg.request_timeout_secs
