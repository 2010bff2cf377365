"""grpc.health.v1.Health with its List method: grpcio-health-checking's asyncio servicer answers Check
and Watch, and leaves List (added to the protocol in 2024) UNIMPLEMENTED, though reflection lists it."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

# gRPC's health protocol: a server with more services than this answers List RESOURCE_EXHAUSTED.
MAX_LISTED_SERVICES = 100


class HealthServicer(health.aio.HealthServicer):
    """Check, Watch and `set` as grpcio's; List answers every service set so far, "" (the server)
    included, with its status."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # the statuses Check answers from
        if len(statuses) > MAX_LISTED_SERVICES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_LISTED_SERVICES} services"
            )
        return health_pb2.HealthListResponse(
            statuses={
                service: health_pb2.HealthCheckResponse(status=status) for service, status in statuses.items()
            }
        )
