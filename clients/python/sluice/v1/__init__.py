"""Generated protobuf and gRPC stubs for sluice.v1 (regenerate with scripts/gen_proto.sh)."""
