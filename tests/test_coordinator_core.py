"""The transport-free coordinator core, driven by simulated ranks on one event loop.

Every rank here does what Checkpointer.save does (flatten, hash, BeginSave, write a real
shard file with the real writer, ReportShard, AwaitCommit), against a real Coordinator
with a real SQLite catalog in tmp_path; only gRPC is absent.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_testutil import tensor_raw
from coordinator_fixtures import (
    RankSim,
    ckptctl,
    new_core,
    read_catalog,
    run,
    shard_index_keys,
    started,
    step_files,
)

import ckpt
from ckptd import knobs
from ckptd.coordinator import planning
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.errors import (
    CheckpointExists,
    DivergentReplicas,
    InvalidRequest,
    SaveAborted,
    StaleGeneration,
    UnsafePath,
)
from ckptd.format import hashing

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def job(root: Path) -> str:
    return str(root / "team" / "run1")


def manifest(job: str, step: int) -> dict:
    with open(Path(job) / f"step-{step:012d}" / "MANIFEST.json", "rb") as f:
        return json.load(f)


def has_manifest(job: str, step: int) -> bool:
    return (Path(job) / f"step-{step:012d}" / "MANIFEST.json").exists()


def sims(core, job: str, world: int, generation: int = 0) -> list[RankSim]:
    return [RankSim(core, job, r, world, generation) for r in range(world)]


async def save_all(ranks: list[RankSim], step: int, states: list, **kw) -> list:
    """Every rank saves concurrently; returns each rank's final status or exception."""
    return await asyncio.gather(
        *(r.save(step, st, **kw) for r, st in zip(ranks, states, strict=True)),
        return_exceptions=True,
    )


async def eventually(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def load_as(job: str, state, rank: int, world: int, monkeypatch, step=None):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return ckpt.load(state, job, step=step)


# ----------------------------------------------------------------------------- planning


def test_concurrent_begin_assigns_every_rank_and_dedups(root: Path, job: str, monkeypatch) -> None:
    """4 ranks join at once: one shard path each, replicas written once, sharded chunks by
    their holder, PerRank by each rank; the result commits, verifies and loads bit-exactly."""
    world = 4
    full = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5)
    rep = torch.randn(64, 3, generator=torch.Generator().manual_seed(3))

    async def main() -> list:
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, world)
            for r, sim in enumerate(ranks):
                sim.prepare(
                    {
                        "rep": rep.clone(),
                        "rows": full[2 * r : 2 * r + 2].clone(),
                        "mine": ckpt.PerRank(torch.full((5,), float(r))),
                        "lr": 0.5,
                    },
                    boxes={"rows": ([8, 5], [2 * r, 0], [2, 5])},
                )
            begun = await asyncio.gather(*(s.begin(7) for s in ranks))
            assert [b.shard_path for b in begun] == [
                f"shards/rank-{r:05d}.bin" for r in range(world)
            ]
            assert [b.index_path for b in begun] == [
                f"shards/rank-{r:05d}.json" for r in range(world)
            ]
            assert all(b.complete for b in begun)
            written = [[ranks[r].plan[i].key for i in b.write] for r, b in enumerate(begun)]
            flat = [k for ks in written for k in ks]
            assert flat.count("rep") == 1, written
            assert flat.count("rows") == world  # every rank its own distinct chunk
            for r in range(world):
                assert "rows" in written[r] and f"mine/@rank{r}" in written[r]
            reports = [await s.write(7) for s in ranks]
            sts = await asyncio.gather(
                *(s.report(7, rep_) for s, rep_ in zip(ranks, reports, strict=True))
            )
            assert {st.status for st in sts} <= {"OPEN", "COMMITTING", "COMMITTED"}
            return await asyncio.gather(*(core.await_commit(s.ref(7), 10) for s in ranks))

    finals = run(main())
    assert [f.status for f in finals] == ["COMMITTED"] * world
    assert len({f.manifest_blake3 for f in finals}) == 1
    m = manifest(job, 7)
    assert m["world_size"] == world and [s["rank"] for s in m["shards"]] == list(range(world))
    keys = shard_index_keys(job, 7)
    all_keys = [k for ks in keys.values() for k in ks]
    assert [k for k in all_keys if k[0] == "rep"] == [("rep", (0, 0), (64, 3))]
    assert sorted(k for k in all_keys if k[0] == "rows") == [
        ("rows", (2 * r, 0), (2, 5)) for r in range(world)
    ]
    rc, out, err = ckptctl("verify", job)
    assert rc == 0, out + err
    rows = read_catalog(root / ".ckptd" / "catalog.sqlite")
    assert rows[7]["status"] == "COMMITTED" and rows[7]["digest"] == finals[0].manifest_blake3
    for r in (0, 3):
        got = {
            "rep": torch.zeros(64, 3),
            "rows": torch.zeros(8, 5),
            "mine": ckpt.PerRank(torch.zeros(5)),
            "lr": 0.0,
        }
        load_as(job, got, r, world, monkeypatch)
        assert tensor_raw(got["rep"]) == tensor_raw(rep)
        assert tensor_raw(got["rows"]) == tensor_raw(full)
        assert tensor_raw(got["mine"].value) == tensor_raw(torch.full((5,), float(r)))
        assert got["lr"] == 0.5


def test_replicas_are_load_balanced(root: Path, job: str) -> None:
    """8 equal replicated tensors on 4 ranks: each rank writes 2; a big one goes alone."""
    world = 4
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, world)
            for s in ranks:
                s.prepare(state)
            return await asyncio.gather(*(s.begin(1) for s in ranks)), ranks

    begun, ranks = run(main())
    counts = [len(b.write) for b in begun]
    assert counts == [2, 2, 2, 2], counts
    keys = sorted(ranks[r].plan[i].key for r, b in enumerate(begun) for i in b.write)
    assert keys == sorted(state)

    # The pure planner: largest first to the least-loaded holder.
    plans = {
        r: [
            planning.ChunkPlan(k, "float32", (n,), (0,), (n,), 4 * n, "h" + k)
            for k, n in [("big", 3000), ("a", 1000), ("b", 1000), ("c", 1000)]
        ]
        for r in range(2)
    }
    a = planning.assign(plans)
    assert a.bytes_by_rank == {0: 12000, 1: 12000}
    assert sorted(len(w) for w in a.write.values()) == [1, 3]


def test_divergent_replicas_fail_every_rank_naming_key_and_ranks(root: Path, job: str) -> None:
    world = 3
    states = [
        {
            "w": torch.ones(4) * (9 if r == 2 else 1),
            "ok": torch.zeros(2),
            "b": torch.full((3,), float(r == 0)),
        }
        for r in range(world)
    ]

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, world)
            return await save_all(ranks, 1, states)

    results = run(main())
    for r, res in enumerate(results):
        assert isinstance(res, DivergentReplicas), (r, res)
        msg = str(res)
        assert "'w'" in msg and "ranks [0, 1]" in msg and "ranks [2]" in msg, msg
        assert "'b'" in msg and "ranks [1, 2]" in msg, msg
        assert "PerRank" in msg
        assert f"rank {r}" in msg
    assert not has_manifest(job, 1)
    assert step_files(job, 1) == []
    row = read_catalog(root / ".ckptd" / "catalog.sqlite")[1]
    assert row["status"] == "ABORTED" and "'w'" in row["reason"]


def test_divergent_dtype_or_shape_is_refused(root: Path, job: str) -> None:
    states = [{"w": torch.ones(4)}, {"w": torch.ones(4, dtype=torch.float64)}]

    async def main():
        core = new_core(root)
        async with started(core):
            return await save_all(sims(core, job, 2), 1, states)

    for res in run(main()):
        assert (
            isinstance(res, DivergentReplicas)
            and "'w'" in str(res)
            and "dtype or shape" in str(res)
        )


def test_allow_divergent_replicas_warns_and_writes_lowest_rank(
    root: Path, job: str, monkeypatch
) -> None:
    states = [{"w": torch.full((4,), float(r + 1))} for r in range(2)]

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s, st in zip(ranks, states, strict=True):
                s.prepare(st)
            begun = await asyncio.gather(ranks[0].begin(1, allow_divergent=True), ranks[1].begin(1))
            for b in begun:
                assert (
                    len(b.warnings) == 1
                    and "'w'" in b.warnings[0]
                    and "lowest rank" in b.warnings[0]
                )
            assert [len(b.write) for b in begun] == [1, 0]
            reps = [await s.write(1) for s in ranks]
            for s, rp in zip(ranks, reps, strict=True):
                await s.report(1, rp)
            return await core.await_commit(ranks[1].ref(1), 10)

    assert run(main()).status == "COMMITTED"
    got = {"w": torch.zeros(4)}
    load_as(job, got, 1, 2, monkeypatch)
    assert torch.equal(got["w"], torch.ones(4))


@pytest.mark.parametrize(
    "boxes, why",
    [
        ([([4], [0], [3]), ([4], [2], [2])], "overlap"),
        ([([6], [0], [2]), ([6], [2], [2])], "cover 4 of 6"),
        ([([4], [0], [2]), ([4], [3], [2])], "outside shape"),
    ],
    ids=["overlap", "gap", "outside"],
)
def test_chunk_tiling_errors(root: Path, job: str, boxes, why: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s, (shape, off, size) in zip(ranks, boxes, strict=True):
                s.prepare({"x": torch.ones(size[0])}, boxes={"x": (shape, off, size)})
            return await asyncio.gather(*(s.begin(1) for s in ranks), return_exceptions=True)

    for res in run(main()):
        assert isinstance(res, InvalidRequest), res
        assert "'x'" in str(res) and why in str(res), str(res)
    assert not has_manifest(job, 1)


def test_state_merge_with_per_rank(root: Path, job: str, monkeypatch) -> None:
    states = [
        {
            "cfg": {"lr": 0.1, "name": "run"},
            "rng": ckpt.PerRank({"seed": 100 + r, "who": [r, "x"]}),
            "t": torch.ones(2),
        }
        for r in range(3)
    ]

    async def main():
        core = new_core(root)
        async with started(core):
            return await save_all(sims(core, job, 3), 5, states)

    assert [r.status for r in run(main())] == ["COMMITTED"] * 3
    per_rank = manifest(job, 5)["state"]
    assert sorted(r for r, _ in next(v for k, v in per_rank["dict"] if k == "rng")["per_rank"]) == [
        0,
        1,
        2,
    ]
    for r in range(3):
        got = {"cfg": {}, "rng": ckpt.PerRank(None), "t": torch.zeros(2)}
        load_as(job, got, r, 3, monkeypatch)
        assert got["rng"].value == {"seed": 100 + r, "who": [r, "x"]}
        assert got["cfg"] == {"lr": 0.1, "name": "run"}


def test_state_values_must_agree_unless_per_rank(root: Path, job: str) -> None:
    states = [{"cfg": {"lr": 0.1 * (r + 1)}, "t": torch.ones(2)} for r in range(2)]

    async def main():
        core = new_core(root)
        async with started(core):
            return await save_all(sims(core, job, 2), 1, states)

    for res in run(main()):
        assert isinstance(res, DivergentReplicas) and "lr" in str(res) and "PerRank" in str(res), (
            res
        )


# ----------------------------------------------------------------------------- reports


def test_report_before_plan_is_refused(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            ranks[0].prepare({"w": torch.ones(3)})
            waiting = asyncio.ensure_future(ranks[0].begin(1))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            fake = ShardReport(
                "shards/rank-00000.bin", 4096, "shards/rank-00000.json", 10, "0" * 64
            )
            with pytest.raises(InvalidRequest, match="before the plan"):
                await core.report_shard(ranks[0].ref(1), fake)
            st = await core.abort_save(ranks[0].ref(1), "test done")
            assert st.status == "ABORTED"
            with pytest.raises(SaveAborted):
                await waiting

    run(main())


def test_duplicate_and_wrong_reports(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for r, s in enumerate(ranks):
                s.prepare({"w": torch.ones(3), "p": ckpt.PerRank(torch.full((4,), float(r)))})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            rep0, rep1 = [await s.write(1) for s in ranks]
            # Another rank's shard, or a path outside the assignment: refused, nothing recorded.
            with pytest.raises(InvalidRequest, match="assigned"):
                await ranks[0].report(1, rep1)
            evil = ShardReport(
                "../../../etc/passwd",
                rep0.size,
                rep0.index_path,
                rep0.index_size,
                rep0.index_blake3,
            )
            with pytest.raises(InvalidRequest):
                await ranks[0].report(1, evil)
            assert (await ranks[0].report(1, rep0)).status == "OPEN"
            assert (await ranks[0].report(1, rep0)).status == "OPEN"  # a retry: harmless
            other = ShardReport(
                rep0.shard_path, rep0.size, rep0.index_path, rep0.index_size, "f" * 64
            )
            with pytest.raises(InvalidRequest, match="different"):
                await ranks[0].report(1, other)
            assert (await ranks[1].report(1, rep1)).status in ("COMMITTING", "COMMITTED")
            final = await core.await_commit(ranks[0].ref(1), 10)
            # A retry that arrives after the commit gets the same answer.
            again = await ranks[1].report(1, rep1)
            return final, again

    final, again = run(main())
    assert final.status == "COMMITTED"
    assert again.status == "COMMITTED" and again.manifest_blake3 == final.manifest_blake3
    assert [s["path"] for s in manifest(job, 1)["shards"]] == [
        "shards/rank-00000.bin",
        "shards/rank-00001.bin",
    ]


def test_report_of_tampered_shard_aborts(root: Path, job: str) -> None:
    """The coordinator's own look: a shard whose size differs from the report aborts the save."""

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s in ranks:
                s.prepare({"w": torch.ones(3), "p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            rep0 = await ranks[0].write(1)
            with open(Path(job) / "step-000000000001" / rep0.shard_path, "ab") as f:
                f.write(b"x")
            st = await ranks[0].report(1, rep0)
            assert (
                st.status == "ABORTED" and "rank-00000.bin" in st.reason and "rank 0" in st.reason
            )
            with pytest.raises(SaveAborted):
                await ranks[1].begin(1)
            await core.close()  # wait for the file removal
            return st

    run(main())
    assert not has_manifest(job, 1)
    assert step_files(job, 1) == []


def test_retried_begin_save_same_answer_different_plan_refused(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s in ranks:
                s.prepare({"w": torch.ones(3), "p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            first = await asyncio.gather(*(s.begin(1) for s in ranks))
            again = await ranks[1].begin(1)
            assert again == first[1]
            ranks[1].prepare({"w": torch.ones(3), "p": ckpt.PerRank(torch.full((4,), 7.0))})
            with pytest.raises(InvalidRequest, match="different plan"):
                await ranks[1].begin(1)

    run(main())


def test_plan_in_parts(root: Path, job: str) -> None:
    """A rank's plan may come in parts; the answer indexes the whole plan."""

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s in ranks:
                s.prepare(
                    {f"k{i}": torch.full((3,), float(i)) for i in range(5)}
                    | {"p": ckpt.PerRank(torch.full((2,), float(s.rank)))}
                )
            r0 = ranks[0]
            first = await core.begin_save(r0.ref(1), r0.plan[:2], part=0, parts=3)
            assert first.complete is False and first.write == []
            again = await core.begin_save(r0.ref(1), r0.plan[:2], part=0, parts=3)  # a retry
            assert again.complete is False
            with pytest.raises(InvalidRequest, match="different plan"):
                await core.begin_save(r0.ref(1), r0.plan[:1], part=0, parts=3)
            with pytest.raises(InvalidRequest, match="parts changed"):
                await core.begin_save(r0.ref(1), r0.plan[2:4], part=1, parts=2)
            with pytest.raises(InvalidRequest, match="bad part"):
                await core.begin_save(r0.ref(1), [], part=3, parts=3)
            with pytest.raises(InvalidRequest, match="world size"):
                await core.begin_save(SaveRef(job, 1, 0, 1, 3), r0.plan, state=r0.node)
            await core.begin_save(r0.ref(1), r0.plan[2:4], part=1, parts=3)
            b0, b1 = await asyncio.gather(
                core.begin_save(r0.ref(1), r0.plan[4:], part=2, parts=3, state=r0.node),
                ranks[1].begin(1),
            )
            r0.begun = b0
            keys0 = [r0.plan[i].key for i in b0.write]
            keys1 = [ranks[1].plan[i].key for i in b1.write]
            assert sorted(keys0 + keys1) == sorted(
                [f"k{i}" for i in range(5)] + ["p/@rank0", "p/@rank1"]
            )
            reps = [await s.write(1) for s in ranks]
            for s, rp in zip(ranks, reps, strict=True):
                await s.report(1, rp)
            return await core.await_commit(r0.ref(1), 10)

    assert run(main()).status == "COMMITTED"
    rc, out, err = ckptctl("verify", job)
    assert rc == 0, out + err


# ----------------------------------------------------------------------------- generations


def test_open_job_generations(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            g_a, name = await core.open_job(job, "attempt-a")
            assert name == "team/run1"
            assert await core.open_job(job, "attempt-a") == (g_a, name)
            assert await core.open_job("team/run1", "attempt-a") == (g_a, name)  # relative form
            g_b, _ = await core.open_job(job, "attempt-b")
            assert (g_a, g_b) == (0, 1)
            assert (await core.open_job(job, "attempt-a"))[
                0
            ] == 0  # an old attempt keeps its number
            assert (await core.open_job(str(root / "other"), "attempt-a"))[0] == 0  # per job
            many = await asyncio.gather(*(core.open_job(job, "attempt-c") for _ in range(8)))
            assert {g for g, _ in many} == {2}
            with pytest.raises(InvalidRequest):
                await core.open_job(job, "")

    run(main())


def test_stale_generation_is_fenced(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            await core.open_job(job, "a")
            await core.open_job(job, "b")  # generation 1: a's ranks are fenced
            old = RankSim(core, job, 0, 1, generation=0)
            old.prepare({"w": torch.ones(3)})
            with pytest.raises(StaleGeneration, match="generation 0 is older"):
                await old.begin(1)
            ref = old.ref(1)
            fake = ShardReport(
                "shards/rank-00000.bin", 4096, "shards/rank-00000.json", 10, "0" * 64
            )
            for call in (
                core.keep_alive(ref),
                core.report_shard(ref, fake),
                core.await_commit(ref, 1),
                core.abort_save(ref, "x"),
            ):
                with pytest.raises(StaleGeneration):
                    await call
            new = RankSim(core, job, 0, 1, generation=1)
            assert (await new.save(1, {"w": torch.ones(3)})).status == "COMMITTED"

    run(main())
    assert manifest(job, 1)["generation"] == 1
    assert step_files(job, 1) == [
        "MANIFEST.json",
        "shards/rank-00000.g1.bin",
        "shards/rank-00000.g1.json",
    ]


def test_newer_generation_aborts_older_open_save(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            old = sims(core, job, 2, generation=0)
            for s in old:
                s.prepare({"w": torch.ones(3), "p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            await asyncio.gather(*(s.begin(3) for s in old))
            rep0 = await old[0].write(3)
            assert (await old[0].report(3, rep0)).status == "OPEN"
            waiting = asyncio.ensure_future(core.await_commit(old[0].ref(3), 20))
            rep1 = await old[1].write(3)  # rank 1 of gen 0 finishes writing, then "sleeps"
            # The job restarts: generation 1 begins the same step.
            new = sims(core, job, 2, generation=1)
            for s in new:
                s.prepare(
                    {"w": torch.full((3,), 2.0), "p": ckpt.PerRank(torch.full((4,), 10.0 + s.rank))}
                )
            first = asyncio.ensure_future(new[0].begin(3))
            st = await asyncio.wait_for(waiting, 10)
            assert st.status == "ABORTED" and "generation 1" in st.reason
            with pytest.raises(StaleGeneration):
                await old[1].report(3, rep1)  # the stale rank cannot add to the new save
            await asyncio.gather(first, new[1].begin(3))
            reps = [await s.write(3) for s in new]
            for s, rp in zip(new, reps, strict=True):
                await s.report(3, rp)
            return await core.await_commit(new[0].ref(3), 10)

    assert run(main()).status == "COMMITTED"
    m = manifest(job, 3)
    assert m["generation"] == 1
    assert all(".g1." in s["path"] for s in m["shards"])
    files = step_files(job, 3)
    assert not any(f.endswith(("rank-00000.bin", "rank-00000.json")) for f in files), files


# ----------------------------------------------------------------------------- aborts


def test_lease_expiry_aborts(root: Path, job: str) -> None:
    async def main():
        core = new_core(root, lease_s=0.4)
        async with started(core):
            ranks = sims(core, job, 2)
            for s in ranks:
                s.prepare({"p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            rep0 = await ranks[0].write(1)
            await ranks[0].report(1, rep0)  # rank 1 never writes, reports, or keeps alive
            t0 = time.monotonic()
            st = await core.await_commit(ranks[0].ref(1), 10)
            elapsed = time.monotonic() - t0
            await eventually(lambda: step_files(job, 1) == [], what="aborted files removed")
            return st, elapsed

    st, elapsed = run(main())
    assert st.status == "ABORTED" and "rank(s) 1" in st.reason and "lease" in st.reason
    assert elapsed < 3
    assert not has_manifest(job, 1)


def test_keep_alive_holds_the_lease(root: Path, job: str) -> None:
    async def main():
        # The lease is short against the 3 s of "writing" but long enough that a loaded
        # machine's fsyncs in write() below do not outlast it.
        core = new_core(root, lease_s=1.0)
        async with started(core):
            ranks = sims(core, job, 1)
            ranks[0].prepare({"w": torch.ones(4)})
            await ranks[0].begin(1)
            for _ in range(12):  # 3 s of writing, renewing every 0.25 s
                assert (await core.keep_alive(ranks[0].ref(1))).status == "OPEN"
                await asyncio.sleep(0.25)
            rep = await ranks[0].write(1)
            await ranks[0].report(1, rep)
            return await core.await_commit(ranks[0].ref(1), 10)

    assert run(main()).status == "COMMITTED"


def test_barrier_timeout_aborts(root: Path, job: str) -> None:
    async def main():
        core = new_core(root, barrier_timeout_s=0.3)
        async with started(core):
            ranks = sims(core, job, 3)
            for s in ranks:
                s.prepare({"w": torch.ones(2)})
            res = await asyncio.gather(ranks[0].begin(1), ranks[2].begin(1), return_exceptions=True)
            late = await asyncio.gather(ranks[1].begin(1), return_exceptions=True)
            return res, late[0]

    res, late = run(main())
    for e in res:
        assert isinstance(e, SaveAborted) and "ranks 1 did not join" in str(e), e
    assert isinstance(late, SaveAborted)
    assert read_catalog(root / ".ckptd" / "catalog.sqlite")[1]["status"] == "ABORTED"


def test_abort_save_aborts_for_every_rank(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 3)
            for s in ranks:
                s.prepare({"p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            rep0 = await ranks[0].write(1)
            rep1 = await ranks[1].write(1)
            await ranks[0].report(1, rep0)
            waiting = asyncio.ensure_future(core.await_commit(ranks[0].ref(1), 20))
            await asyncio.sleep(0.05)  # rank 0 is waiting for the commit
            st = await core.abort_save(ranks[2].ref(1), "ENOSPC: disk full")
            assert st.status == "ABORTED"
            done = await asyncio.wait_for(waiting, 10)
            late = await ranks[1].report(1, rep1)
            again = await core.abort_save(ranks[1].ref(1), "me too")
            await core.close()
            return done, late, again

    done, late, again = run(main())
    for name, st in (("done", done), ("late", late), ("again", again)):
        assert st.status == "ABORTED" and "rank 2 aborted: ENOSPC: disk full" in st.reason, (
            name,
            st,
        )
    assert not has_manifest(job, 1)
    assert step_files(job, 1) == []


def test_abort_before_begin_fails_the_others_at_once(root: Path, job: str) -> None:
    """A rank that fails before BeginSave (say, while staging) aborts the save for all:
    the others' BeginSave fails at once instead of waiting out the barrier."""

    async def main():
        core = new_core(root, barrier_timeout_s=60)
        async with started(core):
            ranks = sims(core, job, 3)
            for s in ranks:
                s.prepare({"w": torch.ones(2)})
            early = asyncio.ensure_future(ranks[0].begin(1))
            await asyncio.sleep(0.05)
            st = await core.abort_save(ranks[1].ref(1), "MemoryError: staging")
            t0 = time.monotonic()
            res = await asyncio.gather(early, ranks[2].begin(1), return_exceptions=True)
            return st, res, time.monotonic() - t0

    st, res, elapsed = run(main())
    assert st.status == "ABORTED" and "rank 1 aborted: MemoryError: staging" in st.reason
    for e in res:
        assert isinstance(e, SaveAborted) and "MemoryError" in str(e), e
    assert elapsed < 5


def test_abort_after_commit_changes_nothing(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            (s,) = sims(core, job, 1)
            assert (await s.save(1, {"w": torch.ones(2)})).status == "COMMITTED"
            return await core.abort_save(s.ref(1), "too late")

    assert run(main()).status == "COMMITTED"
    assert has_manifest(job, 1)


def test_saving_a_committed_step_again_is_refused(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            (s,) = sims(core, job, 1)
            assert (await s.save(1, {"w": torch.ones(2)})).status == "COMMITTED"
            with pytest.raises(CheckpointExists):
                await s.begin(1)

    run(main())


# ----------------------------------------------------------------------------- retention


def test_retention_keeps_newest(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            (s,) = sims(core, job, 1)
            for step in (1, 2, 3, 4):
                assert (
                    await s.save(step, {"w": torch.full((3,), float(step))}, keep_last=2)
                ).status == "COMMITTED"
                await eventually(
                    lambda: len(core.catalog.saves(core.job_name(job), "COMMITTED")) <= 2,
                    what="retention",
                )
            assert [r.step for r in core.list_checkpoints(job)] == [3, 4]
            # A step saved out of order, without lineage (these saves record no parent, so
            # the line is step order): the newest by step is never deleted, and neither is
            # the save just committed, by its own commit's retention (docs/concepts.md).
            assert (await s.save(0, {"w": torch.zeros(3)}, keep_last=1)).status == "COMMITTED"
            await eventually(
                lambda: (
                    [r.step for r in core.catalog.saves(core.job_name(job), "COMMITTED")] == [0, 4]
                ),
                what="retention",
            )
            return [r.step for r in core.list_checkpoints(job)]

    assert run(main()) == [0, 4]
    for step in (1, 2, 3):
        assert not (Path(job) / f"step-{step:012d}").exists()
    assert has_manifest(job, 4) and has_manifest(job, 0)


def test_retention_with_keep_last_one_never_deletes_the_newest(root: Path, job: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            (s,) = sims(core, job, 1)
            for step in (5, 6):
                assert (await s.save(step, {"w": torch.ones(3)}, keep_last=1)).status == "COMMITTED"
        return None

    run(main())
    assert has_manifest(job, 6)
    assert not (Path(job) / "step-000000000005").exists()


# ----------------------------------------------------------------------------- recovery


def _crash_after_reports(root: Path, job: str, reporters: int, world: int = 2):
    """Run a save until `reporters` shards are durably reported, then drop the core on the
    floor (no commit, no close), as a killed process would."""

    async def main():
        core = new_core(root)
        await core.start()
        ranks = sims(core, job, world)
        for s in ranks:
            s.prepare({"w": torch.arange(6.0), "p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
        await asyncio.gather(*(s.begin(9) for s in ranks))
        reps = [await s.write(9) for s in ranks]
        for s, rp in list(zip(ranks, reps, strict=True))[:reporters]:
            await s.report(9, rp)
        for sess in core.sessions.values():  # the commit never got to run: "crash" now
            if sess.commit_task is not None:
                sess.commit_task.cancel()
        # (asyncio.run cancels the rest, the watchdog included, before they run again)
        core.catalog.close()

    run(main())


@pytest.mark.parametrize("status", ["OPEN", "COMMITTING"])
def test_recovery_completes_a_fully_reported_save(
    root: Path, job: str, status: str, monkeypatch
) -> None:
    _crash_after_reports(root, job, reporters=2)
    cat = root / ".ckptd" / "catalog.sqlite"
    db = sqlite3.connect(cat)
    db.execute("UPDATE saves SET status=?", (status,))
    db.commit()
    db.close()
    assert not has_manifest(job, 9)

    async def main():
        core = new_core(root)
        async with started(core):
            return core.get_checkpoint(job, 9), core.get_checkpoint(job, None)

    rec, latest = run(main())
    assert rec.status == "COMMITTED" and latest.step == 9
    data = (Path(job) / "step-000000000009" / "MANIFEST.json").read_bytes()
    assert rec.manifest_blake3 == hashing.digest(data)
    rc, out, err = ckptctl("verify", job)
    assert rc == 0, out + err
    got = {"w": torch.zeros(6), "p": ckpt.PerRank(torch.zeros(4))}
    load_as(job, got, 1, 2, monkeypatch)
    assert torch.equal(got["w"], torch.arange(6.0)) and torch.equal(
        got["p"].value, torch.full((4,), 1.0)
    )


def test_recovery_aborts_a_partly_reported_save(root: Path, job: str) -> None:
    _crash_after_reports(root, job, reporters=1)
    assert step_files(job, 9)  # both shards are on disk, only one was reported

    async def main():
        core = new_core(root)
        async with started(core):
            return core.get_checkpoint(job, 9)

    rec = run(main())
    assert rec.status == "ABORTED" and "1 of 2" in rec.reason
    assert not has_manifest(job, 9)
    assert step_files(job, 9) == []


def test_recovery_finds_a_manifest_written_before_the_crash(root: Path, job: str) -> None:
    """Crash after the manifest rename, before the catalog said COMMITTED."""

    async def main():
        core = new_core(root)
        async with started(core):
            (s,) = sims(core, job, 1)
            assert (await s.save(4, {"w": torch.ones(5)})).status == "COMMITTED"

    run(main())
    db = sqlite3.connect(root / ".ckptd" / "catalog.sqlite")
    db.execute("UPDATE saves SET status='COMMITTING', manifest_blake3='' WHERE step=4")
    db.commit()
    db.close()

    async def again():
        core = new_core(root)
        async with started(core):
            return core.get_checkpoint(job, 4)

    rec = run(again())
    assert rec.status == "COMMITTED"
    assert rec.manifest_blake3 == hashing.digest(
        (Path(job) / "step-000000000004" / "MANIFEST.json").read_bytes()
    )


def test_recovery_never_commits_a_save_whose_shard_vanished(root: Path, job: str) -> None:
    _crash_after_reports(root, job, reporters=2)
    (Path(job) / "step-000000000009" / "shards" / "rank-00001.bin").unlink()

    async def main():
        core = new_core(root)
        async with started(core):
            return core.get_checkpoint(job, 9)

    rec = run(main())
    assert rec.status == "ABORTED", rec
    assert not has_manifest(job, 9)


def test_rebuild_from_storage(root: Path, job: str, tmp_path: Path) -> None:
    other = str(root / "other-job")

    async def main():
        core = new_core(root)
        async with started(core):
            await core.open_job(job, "a")
            await core.open_job(job, "b")  # generation 1
            (s,) = sims(core, job, 1, generation=1)
            for step in (10, 20):
                assert (
                    await s.save(step, {"w": torch.full((3,), float(step))})
                ).status == "COMMITTED"
            (o,) = sims(core, other, 1)
            assert (await o.save(1, {"x": torch.ones(1)})).status == "COMMITTED"
            return {r.step: r.manifest_blake3 for r in core.list_checkpoints(job)}

    before = run(main())
    cat = root / ".ckptd" / "catalog.sqlite"
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(cat) + suffix)
        if p.exists():
            p.unlink()

    async def again():
        core = new_core(root)
        async with started(core):  # a new catalog: start() rebuilds it from the manifests
            recs = core.list_checkpoints(job)
            others = core.list_checkpoints(other)
            gen = core.catalog.generation(core.job_name(job))
            old = RankSim(core, job, 0, 1, generation=0)
            old.prepare({"w": torch.ones(3)})
            with pytest.raises(StaleGeneration):  # the generation survives a rebuild
                await old.begin(30)
            return recs, others, gen

    recs, others, gen = run(again())
    assert {r.step: r.manifest_blake3 for r in recs} == before
    assert all(r.status == "COMMITTED" and r.generation == 1 for r in recs)
    assert [r.step for r in others] == [1]
    assert gen == 1

    # The same through `ckptd rebuild-catalog` (in process).
    from ckptd.cli import serve

    args = serve.build_parser().parse_args(["rebuild-catalog", "--root", str(root)])
    assert serve.rebuild(args) == 0
    assert {
        s: r["digest"] for s, r in read_catalog(cat).items() if r["job"] == "team/run1"
    } == before


def test_rebuild_does_not_recreate_a_job_removed_after_the_walk_listed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new catalog rebuilds from every job under the root. A job removed between the walk
    that listed it and its read (a Lightning checkpoint leaving the top k while a coordinator
    for a sibling path starts) stays removed: the scan reads, it never makes directories."""
    from ckptd.coordinator import recovery

    root = tmp_path / "ckpts"
    for name in ("gone.ckpt", "kept.ckpt"):
        ckpt.save({"w": torch.ones(2)}, str(root / name), step=4)
    real_find = recovery._find_jobs

    def find_then_remove(r: str, *a: object) -> list[str]:
        jobs = real_find(r, *a)
        import shutil

        shutil.rmtree(root / "gone.ckpt")  # removed after the walk listed it
        return jobs

    monkeypatch.setattr(recovery, "_find_jobs", find_then_remove)
    core = new_core(root, catalog=tmp_path / "cat" / "catalog.sqlite")
    try:
        assert core.rebuild_from_storage() == 1
    finally:
        core.catalog.close()
    assert sorted(p.name for p in root.iterdir()) == ["kept.ckpt"]


# ----------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "bad",
    ["/etc", "../escape", "team/../../escape", "{root}/../sibling", "{root}", "team/../job"],
)
def test_job_outside_root_is_refused(root: Path, bad: str) -> None:
    async def main():
        core = new_core(root)
        async with started(core):
            path = bad.format(root=root)
            with pytest.raises((UnsafePath, InvalidRequest)) as ei:
                await core.open_job(path, "a")
            assert isinstance(ei.value, UnsafePath)
            with pytest.raises((UnsafePath, InvalidRequest)):
                await core.begin_save(SaveRef(path, 1, 0, 0, 1), [], state={"int": 1})

    run(main())


def test_job_symlinked_outside_root_is_refused(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir(parents=True)
    os.symlink(outside, root / "link")

    async def main():
        core = new_core(root)
        async with started(core):
            s = RankSim.__new__(RankSim)  # no storage of its own: the path is refused
            s.core, s.job, s.rank, s.world, s.generation = core, str(root / "link"), 0, 1, 0
            s.prepare({"w": torch.ones(2)})
            with pytest.raises(UnsafePath, match="symlink"):
                await s.begin(1)

    run(main())
    assert list(outside.iterdir()) == []


# ----------------------------------------------------------------------------- regressions and bugs


def test_ranks_with_different_block_sizes_end_aborted(root: Path, job: str) -> None:
    """Found by these tests: the block-size check ran outside the commit's error handling
    and left the save COMMITTING forever (fixed in e63eadc)."""

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            full = np.arange(2048, dtype=np.float32)
            for s, bs in zip(ranks, (4096, 8192), strict=True):
                with knobs.override(block_size=bs):
                    half = torch.from_numpy(full[1024 * s.rank : 1024 * (s.rank + 1)].copy())
                    s.prepare({"x": half}, boxes={"x": ([2048], [1024 * s.rank], [1024])})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            for s, bs in zip(ranks, (4096, 8192), strict=True):
                with knobs.override(block_size=bs):
                    rp = await s.write(1)
                await s.report(1, rp)
            st = await core.await_commit(ranks[0].ref(1), 3)
            for sess in list(core.sessions.values()):  # let a stuck session go before closing
                if sess.commit_task is not None and sess.commit_task.done():
                    sess.commit_task.exception()
                sess.fail("test cleanup")
            return st

    st = run(main())
    if not (st.status == "ABORTED" and "block size" in st.reason):
        pytest.fail(f"the save ended {st}", pytrace=False)


def test_await_commit_arriving_during_an_abort_gets_the_final_status(root: Path, job: str) -> None:
    """Found by these tests: an AwaitCommit arriving while an abort was being written to
    the catalog was answered OPEN with no reason (fixed in e63eadc)."""

    async def main():
        core = new_core(root)
        async with started(core):
            ranks = sims(core, job, 2)
            for s in ranks:
                s.prepare({"p": ckpt.PerRank(torch.full((4,), float(s.rank)))})
            await asyncio.gather(*(s.begin(1) for s in ranks))
            rep0 = await ranks[0].write(1)
            await ranks[0].report(1, rep0)
            # Rank 0's AwaitCommit and rank 1's AbortSave arrive together.
            aborting = asyncio.ensure_future(core.abort_save(ranks[1].ref(1), "write failed"))
            waiting = asyncio.ensure_future(core.await_commit(ranks[0].ref(1), 10))
            await aborting
            return await waiting

    st = run(main())
    assert st.status == "ABORTED" and "write failed" in st.reason, st


def test_report_retried_after_restart_gets_the_recovered_answer(root: Path, job: str) -> None:
    _crash_after_reports(root, job, reporters=2)
    # The rank whose report completed the save did not get the answer; it retries.
    rank1 = RankSim(None, job, 1, 2)  # type: ignore[arg-type]
    rank1.prepare({"w": torch.arange(6.0), "p": ckpt.PerRank(torch.full((4,), 1.0))})
    from ckptd.format import layout

    idx = Path(job) / "step-000000000009" / layout.index_name(1)
    data = idx.read_bytes()
    report = ShardReport(
        layout.shard_name(1),
        (Path(job) / "step-000000000009" / layout.shard_name(1)).stat().st_size,
        layout.index_name(1),
        len(data),
        hashing.digest(data),
    )

    async def main():
        core = new_core(root)
        async with started(core):
            assert core.get_checkpoint(job, 9).status == "COMMITTED"
            try:
                return await core.report_shard(rank1.ref(9), report)
            except Exception as e:  # noqa: BLE001 - the bug: an error instead of the answer
                return e

    got = run(main())
    if not (getattr(got, "status", None) == "COMMITTED"):
        pytest.fail(f"retried ReportShard after the restart got {got!r}", pytrace=False)


def test_allow_divergent_writes_the_lowest_rank_copy_even_when_rank0_is_busier(
    root: Path, job: str, monkeypatch
) -> None:
    big = torch.arange(1000, dtype=torch.float32)  # equal on both ranks: rank 0 gets it first
    states = [{"big": big.clone(), "w": torch.full((4,), float(r + 1))} for r in range(2)]

    async def main():
        core = new_core(root)
        async with started(core):
            return await save_all(sims(core, job, 2), 1, states, allow_divergent=True)

    assert [r.status for r in run(main())] == ["COMMITTED"] * 2
    got = {"big": torch.zeros(1000), "w": torch.zeros(4)}
    load_as(job, got, 1, 2, monkeypatch)
    assert torch.equal(got["big"], big)
    if not torch.equal(got["w"], torch.ones(4)):
        pytest.fail(
            f"committed w = {got['w'].tolist()}, not rank 0's copy [1.0, ...]", pytrace=False
        )


def test_an_abort_removes_its_ranks_files_with_one_listing(tmp_path: Path) -> None:
    """What an aborted save leaves is removed by its generation's names, never a file the
    committed step references, and with one listing of the shards however many ranks the
    save named (a 100,000-rank abort, most ranks with nothing written, made 200,000
    removals before)."""
    from ckpt_testutil import DelegatingStorage

    from ckptd.coordinator.session import remove_ranks_files
    from ckptd.format import layout
    from ckptd.format.writer import ahead_name
    from ckptd.storage import open_storage

    job = str(tmp_path / "job")
    ckpt.save({"w": torch.ones(4)}, job, step=3)  # generation 0 commits step 3
    shards = Path(job) / layout.step_dir(3) / layout.SHARDS_DIR
    committed = sorted(p.name for p in shards.iterdir())
    mine = [layout.shard_name(0, 2), layout.index_name(0, 2), layout.shard_name(7, 2)]
    mine.append(ahead_name(layout.shard_name(9, 2)))
    other = [layout.shard_name(1, 1)]  # another generation's: not this abort's
    for name in mine + other:
        (Path(job) / layout.step_dir(3) / name).write_bytes(b"x")

    calls: list[str] = []

    class Counted(DelegatingStorage):
        def remove_tree(self, path: str) -> None:
            calls.append(path)
            self.inner.remove_tree(path)

        def listdir(self, path: str) -> list[str]:
            calls.append(f"listdir {path}")
            return self.inner.listdir(path)

    remove_ranks_files(Counted(open_storage(job)), 3, 2, range(100_000))
    assert sorted(p.name for p in shards.iterdir()) == sorted(
        committed + [n.split("/", 1)[1] for n in other]
    )
    assert len(calls) == 1 + len(mine), calls
    # An abort of the committed step's own generation leaves the files its manifest names.
    remove_ranks_files(open_storage(job), 3, 0, range(4))
    assert set(committed) <= {p.name for p in shards.iterdir()}
    assert ckpt.load({}, job, step=3).state["w"].sum().item() == 4.0
