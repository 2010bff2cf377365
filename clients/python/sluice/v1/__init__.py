"""Generated protobuf and gRPC stubs for sluice.v1 (regenerate with `make proto`)."""
