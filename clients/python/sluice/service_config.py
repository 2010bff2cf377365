"""The gRPC service config Sluice clients use: spread calls over every healthy replica, retry UNAVAILABLE.

    loadBalancingConfig round_robin   one subchannel per address the name resolves to (a headless
                                      Kubernetes Service: one per ready pod); calls rotate over them
    healthCheckConfig                 each subchannel watches grpc.health.v1 for sluice.v1.InferenceService
                                      and leaves the rotation while NOT_SERVING (loading, draining)
    retryPolicy UNAVAILABLE           a call refused by a draining or loading replica (or lost to its
                                      GOAWAY before the server saw it) is retried on another, up to 5
                                      attempts with 0.1 s..1 s backoff; a call that already received a
                                      response message is never retried

The same JSON works in every gRPC language (docs/OPERATIONS.md "Kubernetes with N replicas": Go and Java).

SESSION_AFFINITY_SERVICE_CONFIG is the same with `ring_hash` keyed on a request header (gRFC A76):
every call carrying `x-sluice-session: <id>` goes to the replica the id hashes to on the ring, so a
conversation's turns find their prefix in that replica's KV cache; calls without the header go to a
random replica. A replica leaving (NOT_SERVING, gone from DNS) moves only its own sessions. grpc's C core
(Python, C++, Ruby, ...) reads `requestHashHeader` only with GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY
set to true (checked up to grpcio 1.85.3; without it every call fails "hash attribute not present"):
`enable_request_hash_header()` sets it for this process. See docs/FLEET.md.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": "sluice.v1.InferenceService"},
    "methodConfig": [
        {
            "name": [{"service": "sluice.v1.InferenceService"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}

SERVICE_CONFIG_JSON = json.dumps(SERVICE_CONFIG)

SESSION_HEADER = "x-sluice-session"
REQUEST_HASH_HEADER_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"


def session_affinity_config(header: str = SESSION_HEADER) -> dict[str, Any]:
    """SERVICE_CONFIG with calls placed on a hash ring by the value of request header `header`."""
    config = copy.deepcopy(SERVICE_CONFIG)
    config["loadBalancingConfig"] = [{"ring_hash_experimental": {"requestHashHeader": header}}]
    return config


SESSION_AFFINITY_SERVICE_CONFIG = session_affinity_config()


def enable_request_hash_header() -> None:
    """Lets grpc's C core honour `requestHashHeader` in channels created from now on (unless the
    variable is already set, to anything)."""
    os.environ.setdefault(REQUEST_HASH_HEADER_ENV, "true")


def channel_options(service_config: dict[str, Any] | None, options: list[tuple[str, object]]) -> list:
    """`options` plus the service config (unless None, or `options` already set one) and retries on."""
    if service_config is None or any(name == "grpc.service_config" for name, _ in options):
        return options
    return [*options, ("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 1)]
