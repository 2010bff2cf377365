"""Where the server listens: grpc's address for a host and port, and, when grpc cannot bind it, why,
naming the setting at fault (grpc logs the reason and raises without it)."""

from __future__ import annotations

import errno
import socket


def listen_address(host: str, port: int) -> str:
    """grpc's address for `host` (a name, an IPv4 or an IPv6 address, bracketed or not) and `port`."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_failure(host: str, port: int) -> str:
    """Why `host`:`port` cannot be listened on, once grpc has failed to (it logs the reason, and raises
    without it), naming the setting at fault: `host` when it does not resolve or is no address of this
    machine, else `port` (in use, a privileged port)."""
    address = listen_address(host, port)
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"host: cannot listen on {address}: cannot resolve {host!r} ({exc.strerror})"
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                setting = "host" if exc.errno == errno.EADDRNOTAVAIL else "port"
                return f"{setting}: cannot listen on {address} ({exc.strerror})"
    return f"port: cannot listen on {address}"


class ListenError(Exception):
    """The server cannot listen where its config says (the message names the setting)."""
