"""The gRPC channel a client opens: TLS or not, the service config, and messages of any size received."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import grpc

from sluice.service_config import (
    SERVICE_CONFIG,
    SESSION_AFFINITY_SERVICE_CONFIG,
    channel_options,
    enable_request_hash_header,
)

# gRPC's default of 4 MB would refuse the first chunk of a long prompt asked for `prompt_logprobs` (about
# 200 bytes a prompt token at 20 top): this client takes messages of any size unless told otherwise.
MAX_RECEIVE_OPTION = "grpc.max_receive_message_length"


def open_channel(
    api: ModuleType,
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]],
    service_config: Mapping[str, Any] | None,
    session_affinity: bool = False,
) -> grpc.Channel | grpc.aio.Channel:
    """A channel from `api` (the `grpc` or `grpc.aio` module): TLS when `credentials` are given.
    `session_affinity` swaps the default service config for the ring-hash one; any config keyed on a
    request header (given here or in `options`) gets the header honoured. Messages of any size are
    received unless `options` set MAX_RECEIVE_OPTION."""
    if isinstance(options, Iterable) and not isinstance(options, Mapping | str | bytes):
        options = list(options)  # a generator too: read once, here
    _check_arguments(target, credentials, options, service_config)
    if session_affinity and service_config is SERVICE_CONFIG:
        service_config = SESSION_AFFINITY_SERVICE_CONFIG
    configs = [value for name, value in options if name == "grpc.service_config"]
    if service_config is not None:
        configs.append(json.dumps(service_config))
    if session_affinity or any("requestHashHeader" in str(config) for config in configs):
        enable_request_hash_header()
    options = list(options)
    if not any(name == MAX_RECEIVE_OPTION for name, _ in options):
        options.append((MAX_RECEIVE_OPTION, -1))
    options = channel_options(None if service_config is None else dict(service_config), options)
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


def _check_arguments(target: object, credentials: object, options: object, service_config: object) -> None:
    """A ValueError naming the argument of a type grpc would fail on naming nothing ("'NoneType' object has
    no attribute 'encode'", "too many values to unpack")."""
    if not isinstance(target, str):
        raise ValueError(f"target: must be a str such as 'localhost:50051', got {target!r}")
    if credentials is not None and not isinstance(credentials, grpc.ChannelCredentials):
        raise ValueError(
            f"credentials: must be grpc.ChannelCredentials (ssl_channel_credentials), got {credentials!r}"
        )
    if not isinstance(options, list) or not all(
        isinstance(option, tuple | list) and len(option) == 2 for option in options
    ):
        raise ValueError(f"options: must be (name, value) pairs, got {options!r}")
    if service_config is not None and not isinstance(service_config, Mapping):
        raise ValueError(
            f"service_config: must be a dict (the service config's JSON, parsed), got {service_config!r}"
        )
