"""Save at 4 ranks, load at 1, 2, 3 and 8 (gloo on CPU, spawned processes), bit-exact.

The state (tests/ranks/reshard_worker.py) covers DTensors Shard(0), Shard(1), Replicate
and a 2-D mesh (Shard, Shard), splits that do not divide (one rank of 8 holds no rows), a
model with DTensor parameters and its Adam state, a plain replicated tensor and PerRank
values. Each loading rank compares its local shards with the saved full tensors. One more
run damages a block of the newest step that only one of two loading ranks reads: both
ranks must fall back to the previous step together, and the damaged step is quarantined.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import pytest
from ckpt_testutil import flip_bit
from coordinator_fixtures import free_port
from ranks import reshard_worker

pytestmark = [pytest.mark.multiprocess]


def spawn(world: int, mode: str, job: Path, out: Path, timeout: float = 90) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(
            target=reshard_worker.entry,
            args=(r, world, port, mode, str(job), str(out)),
            daemon=True,
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
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        codes = [p.exitcode for p in procs]
    logs = "\n".join(
        f"--- rank {r}\n{_read(out / f'{mode}-w{world}-rank{r}.log')}" for r in range(world)
    )
    assert not hung, f"ranks {hung} hung:\n{logs}"
    assert codes == [0] * world, f"exit codes {codes}:\n{logs}"
    results = [
        json.loads((out / f"{mode}-w{world}-rank{r}.json").read_text()) for r in range(world)
    ]
    for res in results:
        assert not res.get("error"), res["error"]
        bad = [k for k, ok in res["checks"].items() if not ok]
        assert not bad, f"rank {res['rank']} of {world}: mismatches in {bad}: {res}"
    return results


def _read(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else "<none>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reshard")
    job, out = root / "job", root / "out"
    out.mkdir()
    spawn(4, "save", job, out)
    return job, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_load_at_another_world_size(saved: tuple[Path, Path], world: int) -> None:
    job, out = saved
    results = spawn(world, "load", job, out)
    assert all(r["result"]["fell_back_from"] is None for r in results)


@pytest.mark.timeout(120)
def test_damage_seen_by_one_rank_makes_every_rank_fall_back(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    src, out = saved
    job = tmp_path / "job"
    shutil.copytree(src, job)
    step = job / "step-000000000020"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    # Rows 12.. were saved by rank 3; at 2 ranks only rank 1 needs them, and one rank reads
    # them for both (shared reads): that rank finds the damage, the other hears of it.
    [(shard, entry)] = [
        (s, e)
        for s in manifest["shards"]
        for e in json.loads((step / s["index"]).read_text())["entries"]
        if e["key"] == "rows" and e["chunk_offsets"][0] == 12
    ]
    flip_bit(str(step / shard["path"]), entry["offset"] + 2)
    results = spawn(2, "load-fallback", job, out)
    for r in results:
        assert r["result"]["step"] == 10 and r["result"]["fell_back_from"] == 20
    reasons = [r["result"]["fallback_reason"] for r in results]
    for reason in reasons:
        assert "rows" in reason and shard["path"].split("/")[-1] in reason
    assert sum("another rank" in reason for reason in reasons) == 1
    marker = json.loads((step / "QUARANTINED.json").read_text())
    assert "rows" in marker["reason"] and marker["step"] == 20


@pytest.fixture(scope="module")
def saved_incremental(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reshard-incr")
    job, out = root / "job", root / "out"
    out.mkdir()
    spawn(4, "save-incremental", job, out)
    return job, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_an_incremental_step_loads_at_another_world_size(
    saved_incremental: tuple[Path, Path], world: int
) -> None:
    """Step 20 borrows its unchanged DTensor shards and plain tensor from step 10; a
    resharding load under a process group (shared reads) follows the borrows, bit-exact."""
    job, out = saved_incremental
    m = json.loads((job / "step-000000000020" / "MANIFEST.json").read_text())
    assert m["version"] == 3 and any(s.get("borrows") == [10] for s in m["shards"])
    entries = [
        e
        for s in m["shards"]
        for e in json.loads((job / "step-000000000020" / s["index"]).read_text())["entries"]
    ]
    lent = {e["key"] for e in entries if e["file"].startswith("../step-000000000010/")}
    assert {"rows", "grid", "plain"} <= lent and "cols" not in lent
    results = spawn(world, "load", job, out)
    assert all(r["result"]["step"] == 20 and r["result"]["fell_back_from"] is None for r in results)
