"""Generate the committed protobuf/gRPC Python modules from proto/ (the one and only generator), and the
client's `PacerState` fields from their declaration in coda_server/core/state.py."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# The path relative to PROTO_ROOT is the descriptor's file name: keep it `coda/pacer/v1/pacer.proto`,
# other languages and the reflection service see the contract under that name.
PROTO_FILE = "coda/pacer/v1/pacer.proto"
DEFAULT_OUT = ROOT / "coda_client" / "_proto"
GENERATED = ("pacer_pb2.py", "pacer_pb2.pyi", "pacer_pb2_grpc.py")

# The package's __init__: imports both modules at once, so that runtimes older than the generating versions (an
# engine's pinned grpcio or protobuf) fail at `import coda_client` in one line naming coda-pacer and what it needs.
INIT_TEXT = '''"""Generated protobuf and gRPC modules of coda.pacer.v1 (from scripts/gen_proto.py; do not edit)."""

# The versions these modules were generated with: the oldest runtimes they import under.
GRPCIO_GENERATED = "{grpcio}"
PROTOBUF_GENERATED = "{protobuf}"

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
        f"coda-pacer's client needs grpcio >= {{GRPCIO_GENERATED}} and protobuf >= {{PROTOBUF_GENERATED}} of major "
        f"version {{PROTOBUF_GENERATED.split('.')[0]}} (installed: grpcio {{_installed('grpcio')}}, protobuf "
        f"{{_installed('protobuf')}}): pip install 'grpcio>={{GRPCIO_GENERATED}}' "
        f"'protobuf>={{PROTOBUF_GENERATED}},<{{int(PROTOBUF_GENERATED.split('.')[0]) + 1}}' "
        f"({{type(error).__name__}}: {{error}})") from None
'''
_GRPCIO_GENERATED = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)
_PROTOBUF_GENERATED = re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*"
                                 r"(\d+),\s*(\d+),")

# protoc names imports after the proto package (`from coda.pacer.v1 import pacer_pb2`). A top-level `coda`
# import would resolve to, or shadow, the LoongSage `coda` package in the trainer process, so the gRPC
# module imports its sibling relatively instead.
_GRPC_IMPORT = re.compile(r"^from coda\.pacer\.v1 import pacer_pb2 as (\w+)$", re.MULTILINE)
# The message classes' __module__ would otherwise be 'coda.pacer.v1.pacer_pb2', which pickle (e.g.
# multiprocessing) would try to import; __name__ names the module they really live in.
_PB2_MODULE_NAME = "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'coda.pacer.v1.pacer_pb2', _globals)"
_PB2_MODULE_NAME_FIXED = "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, __name__, _globals)"
_TOP_LEVEL_CODA = re.compile(r"^\s*(from|import)\s+coda(\.|\s|$)", re.MULTILINE)


def _run_protoc(out_dir: Path) -> None:
    """Runs the protoc bundled with grpcio-tools, so the output depends only on its pinned version."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_FILE,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")


def _rewrite(name: str, text: str) -> str:
    """Makes the generated modules importable from inside coda_client without any `coda` package."""
    if name == "pacer_pb2_grpc.py":
        text, count = _GRPC_IMPORT.subn(r"from . import pacer_pb2 as \1", text)
        if count != 1:
            raise SystemExit(f"{name}: expected one pb2 import to rewrite, found {count}")
    elif name == "pacer_pb2.py":
        if text.count(_PB2_MODULE_NAME) != 1:
            raise SystemExit(f"{name}: generated module-name line not found; update scripts/gen_proto.py")
        text = text.replace(_PB2_MODULE_NAME, _PB2_MODULE_NAME_FIXED)
    if _TOP_LEVEL_CODA.search(text):
        raise SystemExit(f"{name}: still imports a top-level `coda` package")
    return text


def generate(out_dir: Path) -> list[Path]:
    """Writes the generated modules and their package __init__ into out_dir; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="gen_proto_") as tmp:
        _run_protoc(Path(tmp))
        gen_dir = Path(tmp) / Path(PROTO_FILE).parent
        for name in GENERATED:
            text = _rewrite(name, (gen_dir / name).read_text(encoding="utf-8"))
            path = out_dir / name
            # Bytes, not text mode: identical output on every platform (no newline translation).
            path.write_bytes(text.encode("utf-8"))
            written.append(path)
    grpcio = _GRPCIO_GENERATED.search((out_dir / "pacer_pb2_grpc.py").read_text(encoding="utf-8"))
    protobuf = _PROTOBUF_GENERATED.search((out_dir / "pacer_pb2.py").read_text(encoding="utf-8"))
    if grpcio is None or protobuf is None:
        raise SystemExit("the generated modules no longer name the versions they were generated with")
    init = out_dir / "__init__.py"
    init.write_bytes(INIT_TEXT.format(grpcio=grpcio.group(1), protobuf=".".join(protobuf.groups())).encode("utf-8"))
    written.append(init)
    return written


CLIENT_TYPES = ROOT / "coda_client" / "types.py"
STATE_BEGIN = "    # BEGIN PacerState fields: generated by scripts/gen_proto.py from coda_server/core/state.py; do not edit\n"
STATE_END = "    # END PacerState fields\n"
# Core annotation -> the client's (the client's records are plain: dict for mappings).
_CLIENT_TYPES = {"Mapping[str, str]": "dict[str, str]"}


def client_state_fields() -> str:
    """The field lines of coda_client.types.PacerState: one per field of the core's declaration, in its order."""
    sys.path.insert(0, str(ROOT))
    from coda_server.core.state import reported_fields

    lines = [STATE_BEGIN]
    for field, how in reported_fields():
        metric = f" Metric: {how.metric}{'_total' if how.kind == 'counter' else ''}." if how.metric else ""
        for line in textwrap.wrap(how.help + metric, 110):
            lines.append(f"    #: {line}\n")
        lines.append(f"    {field.name}: {_CLIENT_TYPES.get(field.type, field.type)}\n")
    lines.append(STATE_END)
    return "".join(lines)


def with_client_state_fields(text: str) -> str:
    """`text` (coda_client/types.py) with its generated region replaced by the current field lines."""
    begin, end = text.find(STATE_BEGIN), text.find(STATE_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{CLIENT_TYPES}: the generated PacerState region's markers are missing")
    return text[:begin] + client_state_fields() + text[end + len(STATE_END):]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: python scripts/gen_proto.py [--out DIR]."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    CLIENT_TYPES.write_bytes(with_client_state_fields(CLIENT_TYPES.read_text(encoding="utf-8")).encode("utf-8"))
    print(CLIENT_TYPES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
