"""A job's Checkpointer closed and opened again within one torchrun launch: the later one
must reach its own zero-config coordinator (and node aggregator), not the closed one's
address left in the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from coordinator_fixtures import TESTS, child_env

from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_job_reopened_in_one_launch_reaches_its_new_coordinator(tmp_path: Path) -> None:
    job = tmp_path / "job"
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "0", str(TESTS / "ranks" / "reopen_worker.py"), str(job)]  # fmt: skip
    with open(log, "wb") as f:
        p = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=150, cwd=tmp_path
        )
    assert p.returncode == 0, log.read_text(errors="replace")[-4000:]
    assert sorted(ckfmt.committed_steps(open_storage(str(job)))) == [1, 2, 3]
