"""Exits 0 when a Sluice server reports SERVING on grpc.health.v1, 1 otherwise (the image's HEALTHCHECK).

    python grpc_health_probe.py [--addr localhost:50051] [--service sluice.v1.InferenceService]
        [--tls] [--tls-ca-cert CA.pem] [--tls-client-cert CERT.pem --tls-client-key KEY.pem]
        [--tls-server-name NAME]

grpc_health_probe binaries cannot be fetched in every build environment, so this uses grpcio-health-checking,
which the image already holds; its TLS flags are grpc_health_probe's (a server started with --tls-cert needs
`--tls-ca-cert`, or `--tls` alone when a system root signs its certificate; with --tls-client-ca also the
client pair). Health checks need no API key.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel_for(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext unless a --tls flag is given."""
    if not (args.tls or args.tls_ca_cert or args.tls_client_cert or args.tls_server_name):
        return grpc.insecure_channel(args.addr)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(args.tls_ca_cert),
        private_key=_read(args.tls_client_key),
        certificate_chain=_read(args.tls_client_cert),
    )
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.addr, credentials, options)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


def check(channel: grpc.Channel, service: str, timeout: float) -> str:
    """The serving status name, or the gRPC status code name when the check call fails."""
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="localhost:50051")
    parser.add_argument("--service", default="sluice.v1.InferenceService")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls", action="store_true", help="TLS, trusting the system's root certificates")
    parser.add_argument("--tls-ca-cert", help="TLS, trusting this CA (PEM) instead")
    parser.add_argument(
        "--tls-client-cert", help="client certificate (PEM), for a server with --tls-client-ca"
    )
    parser.add_argument("--tls-client-key", help="the client certificate's private key (PEM)")
    parser.add_argument("--tls-server-name", help="the name to verify the server's certificate against")
    args = parser.parse_args(argv)
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        parser.error("--tls-client-cert and --tls-client-key go together")
    try:
        channel = channel_for(args)
    except OSError as exc:
        parser.error(f"cannot read {exc.filename}: {exc.strerror}")
    status = check(channel, args.service, args.timeout)
    print(f"{args.addr} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
