"""Server reflection under both of its names: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection serves only v1alpha. grpcurl and `buf curl` try v1 first and fall back on UNIMPLEMENTED,
but a client that speaks only v1 (`buf curl --reflect-protocol grpc-v1`, newer grpc tooling) finds no
service. The two protocols differ only in their package name: their messages are the same on the wire, so
one servicer answers both, and the v1 file's descriptor (v1alpha's, renamed) joins the pool so that v1 can
be described like every other service.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection, v1 and v1alpha, listing `service_names` and both reflection services."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer((*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1_method}),)
    )


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's file, renamed to v1 (package, file name, type references); once per pool."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_package = proto.package
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old_package}."):
                field.type_name = f".{V1_PACKAGE}." + field.type_name.removeprefix(f".{old_package}.")
    for service in proto.service:
        for method in service.method:
            for attribute in ("input_type", "output_type"):
                name = getattr(method, attribute).removeprefix(f".{old_package}.")
                setattr(method, attribute, f".{V1_PACKAGE}.{name}")
    pool.Add(proto)
