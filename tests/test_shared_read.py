"""Loads under a process group read each stored byte once (ckpt._shared_read).

Four gloo ranks (spawned processes) save a state of replicated tensors and a DTensor
split by rows, then load it: with read="auto" the ranks' storage reads (counted by
ckptd.storage.counters, per process) add up to the stored bytes once, and every rank's
values are bit-exact; with read="each" every rank reads what it needs itself. A partial
load (keys=) reads only the selected keys, once. A corrupted block is caught by the one
rank that reads it, and every rank falls back to the previous step together; a bit
flipped between ranks is caught by the receiver, fails the load everywhere and marks
nothing.
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
from ranks import shared_read_worker as worker

pytestmark = [pytest.mark.multiprocess]

WORLD = 4
REP_BYTES = sum(n * 4 for n in worker.REP.values())
HALF_BYTES = worker.HALF_ROWS * WORLD * worker.HALF_COLS * 4
STATE_BYTES = REP_BYTES + HALF_BYTES


def spawn(mode: str, job: Path, out: Path, timeout: float = 90) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=worker.entry, args=(r, WORLD, port, mode, str(job), str(out)))
        for r in range(WORLD)
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
    name = worker._name(mode)
    logs = "\n".join(f"--- rank {r}\n{_read(out / f'{name}-rank{r}.log')}" for r in range(WORLD))
    assert not hung, f"ranks {hung} hung:\n{logs}"
    results = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(WORLD)]
    for res in results:
        assert not res.get("error"), f"rank {res['rank']}: {res['error']}\n{logs}"
        bad = [k for k, ok in res["checks"].items() if not ok]
        assert not bad, f"rank {res['rank']}: values differ in {bad}"
    return results


def _read(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else "<none>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shared")
    job, out = root / "job", root / "out"
    out.mkdir()
    spawn("save", job, out)
    return job, out


@pytest.mark.timeout(150)
def test_a_load_at_four_ranks_reads_each_byte_once(saved: tuple[Path, Path]) -> None:
    job, out = saved
    shared = spawn("load:auto", job, out)
    assert all(len(r["checks"]) == len(worker.REP) + 1 for r in shared)
    assert sum(r["read_bytes"] for r in shared) == STATE_BYTES
    # Balanced: no rank reads more than its share plus one piece.
    assert max(r["read_bytes"] for r in shared) <= STATE_BYTES / WORLD + (1 << 20)
    each = spawn("load:each", job, out)
    # Every rank reads the replicated tensors and its own rows.
    assert sum(r["read_bytes"] for r in each) == WORLD * REP_BYTES + HALF_BYTES


@pytest.mark.timeout(120)
def test_a_partial_load_reads_the_selected_keys_once(saved: tuple[Path, Path]) -> None:
    job, out = saved
    results = spawn("load:auto:rep.*", job, out)
    assert all(set(r["checks"]) == set(worker.REP) for r in results)
    assert sum(r["read_bytes"] for r in results) == REP_BYTES


@pytest.mark.timeout(150)
def test_a_corrupt_block_is_caught_by_its_reader_and_every_rank_falls_back(
    saved: tuple[Path, Path], tmp_path: Path, tally
) -> None:
    src, out = saved
    job = tmp_path / "job"
    shutil.copytree(src, job)
    step = job / "step-000000000002"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    [(shard, entry)] = [
        (s, e)
        for s in manifest["shards"]
        for e in json.loads((step / s["index"]).read_text())["entries"]
        if e["key"] == "rep.3"
    ]
    flip_bit(str(step / shard["path"]), entry["offset"] + 1000)
    with tally.fault("a corrupt block in a load that ranks read together"):
        results = spawn("load:auto", job, out)
    for r in results:
        assert r["result"]["step"] == 1 and r["result"]["fell_back_from"] == 2
        reason = r["result"]["fallback_reason"]
        assert "rep.3" in reason and shard["path"].split("/")[-1] in reason
    # One rank read the block and found it; the others heard it from that rank.
    heard = [r for r in results if "another rank" in r["result"]["fallback_reason"]]
    assert len(heard) == WORLD - 1
    marker = json.loads((step / "QUARANTINED.json").read_text())
    assert "rep.3" in marker["reason"] and marker["step"] == 2


@pytest.mark.timeout(120)
def test_bytes_corrupted_between_ranks_fail_the_load_everywhere_and_mark_nothing(
    saved: tuple[Path, Path], tmp_path: Path, tally
) -> None:
    src, out = saved
    job = tmp_path / "job"
    shutil.copytree(src, job)
    with tally.fault("a bit flipped in a transfer between ranks"):
        results = spawn("load:auto:corrupt-transfer", job, out)
    errors = [r.get("load_error", "") for r in results]
    assert all(errors), errors
    assert "transfer between ranks is corrupt" in errors[1] and "rank" in errors[1]
    assert all("another rank received bytes" in e for i, e in enumerate(errors) if i != 1)
    assert not list(job.glob("step-*/QUARANTINED.json"))
