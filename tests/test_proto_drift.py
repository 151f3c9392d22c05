"""The committed generated code matches proto/ and never pulls a top-level `coda` package into a process."""

from __future__ import annotations

import difflib
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_proto.py"
COMMITTED = ROOT / "coda_client" / "_proto"


def _generated_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.suffix in (".py", ".pyi")}


def _regenerate(out: Path) -> dict[str, bytes]:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    return _generated_files(out)


def test_committed_generated_code_matches_proto(tmp_path: Path) -> None:
    fresh = _regenerate(tmp_path / "fresh")
    committed = _generated_files(COMMITTED)
    assert sorted(committed) == sorted(fresh), "generated file set differs; run: python scripts/gen_proto.py"
    stale = []
    for name, data in fresh.items():
        if committed[name] != data:
            diff = difflib.unified_diff(
                committed[name].decode(errors="replace").splitlines(),
                data.decode(errors="replace").splitlines(),
                f"committed/{name}",
                f"regenerated/{name}",
                lineterm="",
                n=1,
            )
            # Generated lines can be kilobytes long (the serialized descriptor): show line starts, and the
            # bytes around the first difference.
            pairs = enumerate(zip(committed[name], data))
            at = next((i for i, (x, y) in pairs if x != y), min(len(data), len(committed[name])))
            window = slice(max(0, at - 40), at + 40)
            stale.append(
                f"{name}: first difference at byte {at}\n  committed:   {committed[name][window]!r}\n"
                f"  regenerated: {data[window]!r}\n" + "\n".join(line[:160] for line in list(diff)[:30])
            )
    assert not stale, "stale generated code; run: python scripts/gen_proto.py\n" + "\n".join(stale)


def test_generation_is_deterministic(tmp_path: Path) -> None:
    assert _regenerate(tmp_path / "a") == _regenerate(tmp_path / "b")


def test_import_does_not_load_a_coda_package(tmp_path: Path) -> None:
    # A stand-in for LoongSage's `coda` on sys.path: an absolute `coda...` import would find it and load it.
    (tmp_path / "coda").mkdir()
    (tmp_path / "coda" / "__init__.py").write_text("")
    probe = textwrap.dedent(
        """
        import pickle, sys
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        from coda_client._proto import pacer_pb2, pacer_pb2_grpc
        loaded = sorted(m for m in sys.modules if m == "coda" or m.startswith("coda."))
        assert not loaded, loaded
        assert pacer_pb2.DESCRIPTOR.name == "coda/pacer/v1/pacer.proto", pacer_pb2.DESCRIPTOR.name
        assert pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"].full_name == "coda.pacer.v1.RolloutPacer"
        assert pacer_pb2_grpc.RolloutPacerStub
        # Messages name their real module, so pickling one (e.g. multiprocessing) imports no `coda` either.
        message = pacer_pb2.PromptRef(prompt_id="p", epoch=0)
        assert pickle.loads(pickle.dumps(message)) == message
        assert pacer_pb2.PromptRef.__module__ == "coda_client._proto.pacer_pb2", pacer_pb2.PromptRef.__module__
        loaded = sorted(m for m in sys.modules if m == "coda" or m.startswith("coda."))
        assert not loaded, loaded
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path), str(ROOT)], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
