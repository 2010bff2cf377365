"""The TLS flags of Sluice's command-line clients (`sluice generate`, `sluice bench`), as grpc_health_probe
(and deploy/grpc_health_probe.py) names them: plaintext unless one is given.

    --tls                                  TLS, trusting the system's root certificates
    --tls-ca-cert CA.pem                   TLS, trusting this CA (a server's --tls-cert signed by it)
    --tls-client-cert C --tls-client-key K the client's certificate, for a server with --tls-client-ca
    --tls-server-name NAME                 the name to verify the server's certificate against
"""

from __future__ import annotations

import argparse
from typing import Any

import grpc


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls", action="store_true", help="TLS, trusting the system's root certificates")
    parser.add_argument("--tls-ca-cert", metavar="PEM", help="TLS, trusting this CA's certificate instead")
    parser.add_argument(
        "--tls-client-cert", metavar="PEM", help="client certificate, for a server with --tls-client-ca"
    )
    parser.add_argument("--tls-client-key", metavar="PEM", help="the client certificate's private key")
    parser.add_argument("--tls-server-name", help="the name to verify the server's certificate against")


def tls_client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Client` / `AsyncClient` keyword arguments for the flags: `credentials` (None: plaintext) and
    `options`. ValueError naming the flag: a client certificate without its key, a file not readable."""
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise ValueError("tls-client-cert: --tls-client-cert and --tls-client-key go together")
    if not (args.tls or args.tls_ca_cert or args.tls_client_cert or args.tls_server_name):
        return {"credentials": None, "options": ()}
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read("tls-ca-cert", args.tls_ca_cert),
        private_key=_read("tls-client-key", args.tls_client_key),
        certificate_chain=_read("tls-client-cert", args.tls_client_cert),
    )
    name = args.tls_server_name
    return {"credentials": credentials, "options": (("grpc.ssl_target_name_override", name),) if name else ()}


def _read(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path} ({exc.strerror})") from None
