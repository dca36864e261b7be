"""Many real rank processes (gloo on CPU) saving through the zero-config coordinator.

2 and 4 ranks started with multiprocessing (spawn), and 2 ranks under torchrun. Each rank
(tests/ranks/dist_worker.py) saves a model + optimizer (replicated, DDP-style), DTensors
(Shard/Replicate, 1-D and 2-D meshes), a plain replicated tensor and PerRank values, loads
them into a fresh state and compares bit-exactly, then saves replicas that differ and
must be refused on every rank. The test then checks storage: one index entry per chunk
across all ranks (replicas written once, spread over ranks), PerRank entries on their
own rank, no manifest for the refused save, `ckptctl verify` clean, and the catalog.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from coordinator_fixtures import (
    TESTS,
    child_env,
    ckptctl,
    ckptctl_proc,
    free_port,
    read_catalog,
    shard_index_keys,
    step_files,
)
from ranks import dist_worker

pytestmark = [pytest.mark.multiprocess]

REPLICATED_PREFIXES = ("model/", "optim/", "plain", "rep")


def spawn_ranks(world: int, job: Path, out: Path, timeout: float = 90) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(
            target=dist_worker.spawn_entry, args=(r, world, port, str(job), str(out)), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join(10)
        codes = [p.exitcode for p in procs]
        for p in procs:
            p.close()
    logs = "\n".join(f"--- rank {r}\n{_read(out / f'rank{r}.log')}" for r in range(world))
    assert not hung, f"ranks {[procs.index(p) for p in hung]} hung:\n{logs}"
    assert codes == [0] * world, f"exit codes {codes}:\n{logs}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _read(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else "<none>"


def check_results(results: list[dict], world: int) -> None:
    for res in results:
        assert not res.get("error"), res.get("error")
        assert res["checks"] and all(res["checks"].values()), (res["rank"], res["checks"])
        div = res["divergent"]
        assert div.startswith("DivergentReplicas: "), (res["rank"], div)
        assert "'x'" in div and "'same'" not in div and "PerRank" in div, div
    assert len({r["generation"] for r in results}) == 1
    assert len({r["attempt"] for r in results}) == 1


def check_storage(job: Path, world: int, *, verify_in_subprocess: bool = False) -> None:
    m = json.loads((job / "step-000000000010" / "MANIFEST.json").read_text())
    assert m["world_size"] == world and [s["rank"] for s in m["shards"]] == list(range(world))
    assert m["metadata"] == {"world": world}
    keys = shard_index_keys(job, 10)
    every = [k for ks in keys.values() for k in ks]
    dup = [k for k, n in Counter(every).items() if n > 1]
    assert not dup, f"chunks written more than once: {dup}"
    names = Counter(k[0] for k in every)
    replicated = [k for k in names if k.startswith(REPLICATED_PREFIXES)]
    assert any(k.startswith("model/") for k in replicated) and any(
        k.startswith("optim/") for k in replicated
    )
    assert all(names[k] == 1 for k in replicated), {k: names[k] for k in replicated}
    writers = {r for r, ks in keys.items() for k in ks if k[0].startswith(REPLICATED_PREFIXES)}
    assert len(writers) >= 2, f"all replicated tensors written by ranks {writers}: not balanced"
    blocks = 2 if world > 2 else world  # 2-D mesh: row blocks are replicated on 2 ranks
    assert names["rows"] == blocks
    assert sorted(k[1] for k in every if k[0] == "rows") == [
        (12 // blocks * i, 0) for i in range(blocks)
    ]
    assert names["grid"] == (4 if world > 2 else world)
    for r in range(world):
        assert [k[0] for k in keys[r] if k[0].startswith("mine/")] == [f"mine/@rank{r}"]
    assert not (job / "step-000000000011" / "MANIFEST.json").exists()
    assert step_files(job, 11) == []
    if verify_in_subprocess:
        rc, out, err = ckptctl_proc("verify", str(job), "--all")
    else:
        rc, out, err = ckptctl("verify", str(job), "--all")
    assert rc == 0 and "step 10: OK" in out, out + err
    rows = read_catalog(job / ".ckptd" / "catalog.sqlite")
    assert rows[10]["status"] == "COMMITTED" and rows[10]["world_size"] == world
    assert rows[11]["status"] == "ABORTED" and "'x'" in rows[11]["reason"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_zero_config_ranks_save_load_dedup(tmp_path: Path, world: int) -> None:
    job = tmp_path / "ckpts" / "run"
    results = spawn_ranks(world, job, tmp_path / "out")
    check_results(results, world)
    check_storage(job, world, verify_in_subprocess=world == 2)


@pytest.mark.timeout(150)
def test_torchrun_two_ranks(tmp_path: Path) -> None:
    job = tmp_path / "ckpts" / "run"
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "torchrun.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(TESTS / "ranks" / "dist_worker.py"),
        str(job),
        str(out),
    ]
    with open(log, "wb") as f:
        p = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=120, cwd=tmp_path
        )
    assert p.returncode == 0, log.read_text(errors="replace")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    check_results(results, 2)
    assert results[0]["attempt"].endswith("/0")  # torchelastic's run id / restart count
    check_storage(job, 2)
