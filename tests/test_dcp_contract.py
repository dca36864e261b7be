"""DCP's whole StorageWriter/StorageReader contract through ckpt.integrations.dcp.

The scenarios of DCP's own storage tests (FileSystemWriter/Reader), written anew and run by
one 4-rank torchrun job (gloo, CPU; tests/ranks/dcp_contract_worker.py): tensors only;
ShardedTensors written and read with 1 and 2 I/O threads; several chunks of one key on one
rank, loaded with another shard plan (and back); rowwise to colwise; bytes and io.BytesIO
values; DTensors resharded across 1-D and 2-D meshes; async_save with the thread and the
process executor; partial loads (a state dict with fewer keys, DCP's load by keys,
_EmptyStateDictLoadPlanner with and without keys); dcp_to_torch_save / torch_save_to_dcp;
a committed step that a second save must not overwrite; and dcp.save(use_collectives=False),
each rank committing its own part through ckptd's coordinator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from coordinator_fixtures import TESTS, child_env

from ckpt.integrations.dcp import StorageReader  # noqa: F401 - the integration imports

SCENARIOS = [
    "no_collectives",
    "tensors_only",
    "sharded_threads_1",
    "sharded_threads_2",
    "different_shard_plan",
    "rowwise_to_colwise",
    "bytes_values",
    "dtensor_meshes",
    "async_thread",
    "async_process",
    "partial_and_empty_planner",
    "overwrite_refused",
]
WORLD = 4


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("dcp_contract")
    jobs, out = base / "jobs", base / "out"
    jobs.mkdir()
    out.mkdir()
    log = base / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), "--max-restarts", "0", str(TESTS / "ranks" / "dcp_contract_worker.py"),
           str(jobs), str(out)]  # fmt: skip
    with open(log, "wb") as f:
        p = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=400, cwd=base
        )
    assert p.returncode == 0, log.read_text(errors="replace")[-6000:]
    return jobs, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", SCENARIOS)
def test_dcp_storage_scenario(contract, name: str) -> None:
    _, results = contract
    for res in results:
        rec = res["scenarios"][name]
        assert rec["error"] is None, f"rank {res['rank']}: {rec['error']}"
        assert rec["checks"] and all(rec["checks"].values()), (res["rank"], rec["checks"])


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_several_chunks_of_a_key_on_a_rank_are_entries_of_its_shard(contract) -> None:
    jobs, _ = contract
    step = jobs / "different_shard_plan" / "step-000000000001"
    m = json.loads((step / "MANIFEST.json").read_text())
    boxes: list[tuple[int, tuple[int, ...]]] = []
    for sh in m["shards"]:
        idx = json.loads((step / sh["index"]).read_text())
        mine = [tuple(e["chunk_offsets"]) for e in idx["entries"] if e["key"] == "st"]
        assert len(mine) == 2, (sh["rank"], mine)  # two row blocks of 'st' on every rank
        boxes += [(sh["rank"], b) for b in mine]
    # block i (2 rows of 16) on rank i % 4: the boxes tile the tensor once
    assert sorted(b for _, b in boxes) == [(2 * i, 0) for i in range(8)]
    assert all(r == (b[0] // 2) % WORLD for r, b in boxes)
    from coordinator_fixtures import ckptctl

    rc, out, err = ckptctl("verify", str(jobs / "different_shard_plan"), "--all")
    assert rc == 0, out + err
