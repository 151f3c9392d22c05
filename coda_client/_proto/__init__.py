"""Generated protobuf and gRPC modules of coda.pacer.v1 (from scripts/gen_proto.py; do not edit)."""
