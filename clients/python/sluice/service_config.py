"""The gRPC service config Sluice clients use: spread calls over every healthy replica, retry UNAVAILABLE.

    loadBalancingConfig round_robin   one subchannel per address the name resolves to (a headless
                                      Kubernetes Service: one per ready pod); calls rotate over them
    healthCheckConfig                 each subchannel watches grpc.health.v1 for sluice.v1.InferenceService
                                      and leaves the rotation while NOT_SERVING (loading, draining)
    retryPolicy UNAVAILABLE           a call refused by a draining or loading replica (or lost to its
                                      GOAWAY before the server saw it) is retried on another, up to 5
                                      attempts with 0.1 s..1 s backoff; a call that already received a
                                      response message is never retried

The same JSON works in every gRPC language (README "Clients and rollouts": Go and Java).
"""

from __future__ import annotations

import json
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


def channel_options(service_config: dict[str, Any] | None, options: list[tuple[str, object]]) -> list:
    """`options` plus the service config (unless None, or `options` already set one) and retries on."""
    if service_config is None or any(name == "grpc.service_config" for name, _ in options):
        return options
    return [*options, ("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 1)]
