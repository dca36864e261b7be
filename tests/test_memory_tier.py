"""The in-memory tier with real processes: four gloo ranks as two nodes (and three as a
ring of three nodes), each node with its own shared-memory directory and its own `ckptd
agent` (ckpt._memory, ckptd.agent); the coordinator commits each memory step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest
from coordinator_fixtures import spawn_ranks
from ranks import memory_rank

from ckptd.format import layout

WORLD = 4


def run_job(
    job: Path,
    out: Path,
    spec: dict,
    *,
    expect_crash: bool = False,
    timeout: float = 180,
    world: int = WORLD,
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = spawn_ranks(
        memory_rank.entry,
        world,
        lambda r, port: (r, world, port, str(job), str(out), spec),
        out,
        timeout=timeout,
        log_tail=6000,
    )
    if expect_crash:
        victim = spec.get("victim", 1)
        assert procs[victim].exitcode == -signal.SIGKILL, logs
        return []
    assert [p.exitcode for p in procs] == [0] * world, logs
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert "error" not in r, logs
    return results


def by_rank(shard_tiers: dict[str, str]) -> dict[int, str]:
    """LoadResult.shard_tiers of step 6, keyed by the rank whose shard file it is."""
    out = {}
    for path, where in shard_tiers.items():
        step_dir, _, name = path.partition("/shards/")
        assert step_dir == layout.step_dir(6), path
        out[int(name.split("-")[1].split(".")[0])] = where
    return out


def agent_pid(shm: Path, node: int) -> int:
    return int(json.loads((shm / f"node{node}" / "agent.json").read_text())["pid"])


def kill_agent(shm: Path, node: int) -> None:
    try:
        os.kill(agent_pid(shm, node), signal.SIGKILL)
    except (OSError, ValueError):
        pass


@pytest.fixture
def shm(tmp_path: Path):
    d = tmp_path / "shm"
    d.mkdir()
    yield d
    for node in range(WORLD):  # as many nodes as ranks at most
        kill_agent(d, node)


def spec_for(shm: Path, **kw) -> dict:
    return {"shm": str(shm), "steps": 10, "memory_every": 2, "every": 5, **kw}


@pytest.fixture
def reference(tmp_path: Path) -> list[dict]:
    """An uninterrupted run (its own job and agents): the final state to be equal to."""
    shm = tmp_path / "shm-ref"
    shm.mkdir()
    try:
        return run_job(tmp_path / "ref-job", tmp_path / "ref-out", spec_for(shm))
    finally:
        for node in range(WORLD // 2):
            kill_agent(shm, node)


@pytest.mark.slow
def test_a_killed_rank_resumes_from_its_own_nodes_memory(tmp_path, shm, reference, tally):
    job = tmp_path / "job"
    with tally.fault("memory:rank-killed"):
        run_job(job, tmp_path / "out1", spec_for(shm, crash_at=7, victim=1), expect_crash=True)
        # Step 6 is a memory step only: storage holds step 5.
        assert not (job / layout.step_dir(6)).exists()
        results = run_job(job, tmp_path / "out2", spec_for(shm))
        assert [r["resumed"] for r in results] == [6] * WORLD
        assert [r["tier"] for r in results] == ["memory"] * WORLD
        assert [r["digest"] for r in results] == [r["digest"] for r in reference]
        # Per shard file: the restarted rank took its own and rank 0's (the replicated
        # tensor, written once) from its own node's memory; every rank's own shard came
        # from its own node's (a shared read: a file's reader is the rank that needs it).
        came = [by_rank(r["shard_tiers"]) for r in results]
        assert came[1] == {0: "memory", 1: "memory"}, came
        assert [c[r] for r, c in enumerate(came)] == ["memory"] * WORLD, came
    # The catalog records which tiers hold each step: step 6 is held in memory.
    with sqlite3.connect(job / ".ckptd" / "catalog.sqlite") as db:
        rows = dict(db.execute("SELECT step, status FROM tiers WHERE tier='memory'").fetchall())
    assert rows.get(6) == "HELD" and rows.get(8) == "HELD", rows


@pytest.mark.slow
def test_a_lost_node_resumes_from_the_peers_copy_bit_identical(tmp_path, shm, reference, tally):
    job = tmp_path / "job"
    with tally.fault("memory:node-lost"):
        run_job(job, tmp_path / "out1", spec_for(shm, crash_at=7, victim=2), expect_crash=True)
        kill_agent(shm, 1)
        shutil.rmtree(shm / "node1")  # the node is replaced: agent and shared memory gone
        results = run_job(job, tmp_path / "out2", spec_for(shm))
        assert [r["resumed"] for r in results] == [6] * WORLD
        assert [r["tier"] for r in results] == ["memory", "memory", "peer", "peer"]
        assert [r["digest"] for r in results] == [r["digest"] for r in reference]
        # The replaced node's ranks took every shard file from node 0's memory.
        assert [by_rank(r["shard_tiers"]) for r in results] == [
            {0: "memory"},
            {0: "memory", 1: "memory"},
            {0: "peer:node0", 2: "peer:node0"},
            {0: "peer:node0", 3: "peer:node0"},
        ]


@pytest.mark.slow
def test_a_flipped_bit_in_the_peers_copy_falls_back_to_storage(tmp_path, shm, reference, tally):
    job = tmp_path / "job"
    with tally.fault("memory:peer-bitflip"):
        run_job(job, tmp_path / "out1", spec_for(shm, crash_at=7, victim=2), expect_crash=True)
        kill_agent(shm, 1)
        shutil.rmtree(shm / "node1")
        # Node 0's agent holds node 1's shards of step 6: flip one bit of rank 2's.
        shard = shm / "node0" / layout.step_dir(6) / layout.shard_name(2, 1)
        if not shard.exists():
            shard = next(
                (shm / "node0" / layout.step_dir(6) / layout.SHARDS_DIR).glob("rank-00002*.bin")
            )
        with open(shard, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x10]))
        results = run_job(job, tmp_path / "out2", spec_for(shm))
        # Step 6's parent is step 5, the persistent one: the fallback reads storage.
        assert [r["resumed"] for r in results] == [5] * WORLD
        assert [r["fell_back_from"] for r in results] == [6] * WORLD
        assert [r["tier"] for r in results] == ["local"] * WORLD
        assert [set(r["shard_tiers"].values()) for r in results] == [{"local"}] * WORLD
        assert [r["digest"] for r in results] == [r["digest"] for r in reference]
        log = "".join((tmp_path / "out2" / f"rank{r}.log").read_text() for r in (2, 3))
        assert "FAILED VERIFICATION" in log


@pytest.mark.slow
def test_both_nodes_lost_resume_from_storage(tmp_path, shm, reference, tally):
    job = tmp_path / "job"
    with tally.fault("memory:both-nodes-lost"):
        run_job(job, tmp_path / "out1", spec_for(shm, crash_at=7, victim=0), expect_crash=True)
        for node in (0, 1):
            kill_agent(shm, node)
            shutil.rmtree(shm / f"node{node}")
        results = run_job(job, tmp_path / "out2", spec_for(shm))
        assert [r["resumed"] for r in results] == [5] * WORLD
        assert [r["tier"] for r in results] == ["local"] * WORLD
        assert [set(r["shard_tiers"].values()) for r in results] == [{"local"}] * WORLD
        assert [r["digest"] for r in results] == [r["digest"] for r in reference]


@pytest.mark.slow
def test_the_agents_budget_holds_under_a_save_loop(tmp_path, shm, tally):
    # Each rank's shard is ~1 MiB; a node holds its two ranks' shards and the peer's two:
    # ~4 MiB a step, so 10 MiB holds two steps and the step count (3) never binds first.
    budget = 10 << 20
    spec = spec_for(
        shm, steps=16, memory_every=1, every=100, max_steps=3, max_bytes=budget, budget_probe=True
    )
    results = run_job(tmp_path / "job", tmp_path / "out", spec)
    for r in results:
        assert len(r["usage"]) == 16
        for u in r["usage"]:
            assert u["bytes"] <= budget and len(u["steps"]) <= 3, u
        assert set(r["memory"].values()) == {"placed"}, r["memory"]
    held = sorted(p.name for p in (shm / "node0").iterdir() if p.name.startswith("step-"))
    assert held[-1] == layout.step_dir(16) and len(held) == 2


@pytest.mark.slow
def test_a_shard_over_the_budget_is_refused_and_training_goes_on(tmp_path, shm, tally):
    spec = spec_for(shm, steps=6, memory_every=2, every=5, max_bytes=512 << 10)
    with tally.bad_input("memory:over-budget"):
        results = run_job(tmp_path / "job", tmp_path / "out", spec)
        for r in results:
            outcomes = [r["memory"][k] for k in ("2", "4", "6")]
            assert all("MemoryBudgetExceeded" in o and "max_bytes=524288" in o for o in outcomes)
            assert r["final"] == 6
        assert (tmp_path / "job" / layout.step_dir(5) / layout.MANIFEST_NAME).exists()


@pytest.mark.slow
def test_a_ring_of_three_nodes_loses_one_and_resumes_bit_identical(tmp_path, shm, tally):
    # Three nodes of one rank, one replica: node i's shard is on nodes i and i+1, so no
    # node holds every shard; each rank reads what its node lacks from the holder.
    spec = spec_for(shm, per_node=1)
    ref_shm = tmp_path / "shm-ref3"
    ref_shm.mkdir()
    try:
        reference = run_job(
            tmp_path / "ref3", tmp_path / "ref3-out", {**spec, "shm": str(ref_shm)}, world=3
        )
    finally:
        for node in range(3):
            kill_agent(ref_shm, node)
    job = tmp_path / "job"
    with tally.fault("memory:ring-node-lost"):
        run_job(
            job, tmp_path / "out1", {**spec, "crash_at": 7, "victim": 1}, expect_crash=True, world=3
        )
        for node in range(3):  # every step of the ring was committed and is held twice
            held = shm / f"node{node}" / layout.step_dir(6)
            assert (held / layout.MANIFEST_NAME).exists(), node
            assert len(list((held / layout.SHARDS_DIR).glob("*.bin"))) == 2, node
        kill_agent(shm, 1)
        shutil.rmtree(shm / "node1")  # node 1 replaced: its agent and memory gone
        results = run_job(job, tmp_path / "out2", spec, world=3)
        assert [r["resumed"] for r in results] == [6] * 3
        assert [r["tier"] for r in results] == ["memory", "peer", "memory"]
        # Rank 2's copy is its node's memory, but rank 0's shard (the replicated tensor) is
        # held on nodes 0 and 1 only: it came from node 0; the replaced node 1 took its own
        # shard from node 2 (its ring successor, which holds it) and rank 0's from node 0.
        assert [by_rank(r["shard_tiers"]) for r in results] == [
            {0: "memory"},
            {0: "peer:node0", 1: "peer:node2"},
            {0: "peer:node0", 2: "memory"},
        ]
        assert [r["digest"] for r in results] == [r["digest"] for r in reference]
    with sqlite3.connect(job / ".ckptd" / "catalog.sqlite") as db:
        rows = dict(db.execute("SELECT step, status FROM tiers WHERE tier='memory'").fetchall())
    assert rows.get(6) == "HELD", rows
