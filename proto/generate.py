"""Generate the Python code for the specpilot.v1 protos with grpcio-tools' protoc.

    python proto/generate.py          # (re)write proto/specpilot/v1/*_pb2*.py(i)
    python proto/generate.py --check  # exit 1 naming the files if the committed code is stale

The generated modules live next to their .proto files, so `proto/` is the source root of the
`specpilot.v1` Python package (see pyproject.toml).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "specpilot" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under specpilot/v1 and return the generated files."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Generated files that differ from what protoc produces now (missing or extra ones too)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p for p in _generate(Path(tmp))}
        committed = {
            p.relative_to(PROTO_ROOT): p
            for p in PACKAGE_DIR.iterdir()
            if p.name.endswith(GENERATED_SUFFIXES)
        }
        stale = [str(rel) for rel in fresh if rel not in committed]
        stale += [str(rel) for rel in committed if rel not in fresh]
        stale += [
            str(rel)
            for rel, path in fresh.items()
            if rel in committed and not filecmp.cmp(path, committed[rel], shallow=False)
        ]
        return sorted(stale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale generated files")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated protobuf code (run: python proto/generate.py):",
                  *stale, sep="\n  ")
            return 1
        print("generated protobuf code is up to date")
        return 0
    for old in PACKAGE_DIR.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()
    written = _generate(PROTO_ROOT)
    print(f"wrote {len(written)} files under {PACKAGE_DIR.relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
