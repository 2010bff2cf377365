"""Exits 0 when a Sluice server reports SERVING on grpc.health.v1, 1 otherwise (the image's HEALTHCHECK).

    python grpc_health_probe.py [--addr localhost:50051] [--service sluice.v1.InferenceService]

grpc_health_probe binaries cannot be fetched in every build environment, so this uses grpcio-health-checking,
which the image already holds. Health checks need no API key.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str, timeout: float) -> str:
    """The serving status name, or the gRPC status code name when the check call fails."""
    with grpc.insecure_channel(addr) as channel:
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
    args = parser.parse_args(argv)
    status = check(args.addr, args.service, args.timeout)
    print(f"{args.addr} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
