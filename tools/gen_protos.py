"""Generate the gRPC stubs of pdcluster/protos/*.proto (committed; a test checks they are current).

Usage: python tools/gen_protos.py [--out DIR]   (default: pdcluster/protos, fixing imports)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "pdcluster" / "protos"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto.name} (exit {rc})")
        stem = proto.stem
        grpc_file = out_dir / f"{stem}_pb2_grpc.py"
        # Generated stubs import their sibling module as a top-level name; make it a package import.
        text = grpc_file.read_text()
        text = re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", text, flags=re.M)
        grpc_file.write_text(text)
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", grpc_file]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if args.out == PROTO_DIR else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
