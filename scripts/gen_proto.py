"""Regenerate the gRPC stubs from proto/: `python scripts/gen_proto.py [OUT_DIR]`.

The stubs land in ckptd/v1/ (the proto package ckptd.v1 maps onto our package, so the
generated imports resolve without path tricks). tests/test_proto_stubs.py regenerates
into a temporary directory and fails when the committed stubs differ.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))


def generate(out: pathlib.Path) -> None:
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in PROTOS),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
