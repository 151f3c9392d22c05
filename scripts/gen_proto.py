"""Generate the committed protobuf/gRPC Python modules from proto/ (the one and only generator)."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# The path relative to PROTO_ROOT is the descriptor's file name: keep it `coda/pacer/v1/pacer.proto`,
# other languages and the reflection service see the contract under that name.
PROTO_FILE = "coda/pacer/v1/pacer.proto"
DEFAULT_OUT = ROOT / "coda_client" / "_proto"
GENERATED = ("pacer_pb2.py", "pacer_pb2.pyi", "pacer_pb2_grpc.py")

INIT_TEXT = '''"""Generated protobuf and gRPC modules of coda.pacer.v1 (from scripts/gen_proto.py; do not edit)."""
'''

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
    init = out_dir / "__init__.py"
    init.write_bytes(INIT_TEXT.encode("utf-8"))
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: python scripts/gen_proto.py [--out DIR]."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
