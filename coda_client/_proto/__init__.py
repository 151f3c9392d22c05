"""Generated protobuf and gRPC modules of coda.pacer.v1 (from scripts/gen_proto.py; do not edit)."""

# The versions these modules were generated with: the oldest runtimes they import under.
GRPCIO_GENERATED = "1.85.1"
PROTOBUF_GENERATED = "7.35.1"

try:
    from . import pacer_pb2, pacer_pb2_grpc
except Exception as error:  # protobuf's VersionError, the gRPC stub's RuntimeError, an ImportError
    from importlib.metadata import PackageNotFoundError, version

    def _installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    raise ImportError(
        f"coda-pacer's client needs grpcio >= {GRPCIO_GENERATED} and protobuf >= {PROTOBUF_GENERATED} of major "
        f"version {PROTOBUF_GENERATED.split('.')[0]} (installed: grpcio {_installed('grpcio')}, protobuf "
        f"{_installed('protobuf')}): pip install 'grpcio>={GRPCIO_GENERATED}' "
        f"'protobuf>={PROTOBUF_GENERATED},<{int(PROTOBUF_GENERATED.split('.')[0]) + 1}' "
        f"({type(error).__name__}: {error})") from None
