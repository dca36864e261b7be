"""The committed gRPC stubs are exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from coordinator_fixtures import PY, REPO, child_env

STUBS = ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py")


@pytest.mark.timeout(120)
def test_generated_stubs_match_committed(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    p = subprocess.run(
        [PY, str(REPO / "scripts" / "gen_proto.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=child_env(),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for name in STUBS:
        fresh = tmp_path / "ckptd" / "v1" / name
        committed = REPO / "ckptd" / "v1" / name
        assert fresh.exists(), f"gen_proto.py did not write {name}"
        assert fresh.read_bytes() == committed.read_bytes(), (
            f"ckptd/v1/{name} differs from what `python scripts/gen_proto.py` generates from "
            "proto/; regenerate the stubs and commit them with the .proto change"
        )
    # Nothing else was generated that the package lacks.
    made = sorted(p.name for p in (tmp_path / "ckptd" / "v1").iterdir() if p.is_file())
    assert made == sorted(STUBS)
