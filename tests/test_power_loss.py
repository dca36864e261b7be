"""Power loss on the local storage path: every crash moment of a run, checked.

A run of saves (steps 1-4, keep_last=2, so retention retires steps and a later save
overwrites a recycled shard file) is recorded by tests/powerloss.py; each image of what a
power cut would leave (one after every fsync, plus one right after each save returned) is
written out as a real tree, and on it:

- every step with a manifest verifies (committed means whole: no shard, index or byte
  missing), and no manifest is torn;
- the newest committed step is the newest acknowledged one or the one being saved,
  i.e. a save that returned is never lost, and nothing half-saved shows as committed;
- that step loads bit-exactly.

Two runs: the single-process path (ckpt.save, no coordinator) and two ranks through the
coordinator core (its commit and retention), both writing through LocalStorage in this
process. The simulator must catch a missing directory fsync: with one fsync_dir call
site made a no-op, the same run must show a violation.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from coordinator_fixtures import RankSim, new_core, run, started
from crash_harness import assert_loads
from powerloss import Image, PowerLoss, materialize, reachable
from ranks.plain_rank import make_state

import ckpt
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import local, open_storage

STEPS = (1, 2, 3, 4)
KEEP = 2


def client_run(sim: PowerLoss, job: Path) -> int:
    """Single process: ckpt.save writes shard, index and manifest itself; world 1."""
    for step in STEPS:
        sim.phase(step)
        ckpt.save(
            make_state(step, 0, step), job, step=step, metadata={"seed": step}, keep_last=KEEP
        )
        sim.ack(step)
    sim.phase(None)
    return 1


def coordinator_run(sim: PowerLoss, job: Path) -> int:
    """Two ranks through the coordinator core: it checks, commits and retires."""

    async def go() -> None:
        async with started(new_core(sim.root)) as core:
            for step in STEPS:
                sim.phase(step)
                sims = [RankSim(core, str(job), r, 2) for r in range(2)]
                for s in sims:
                    s.prepare(make_state(step, s.rank, step))
                got = await asyncio.gather(
                    *(s.save(step, metadata={"seed": step}, keep_last=KEEP) for s in sims)
                )
                assert [g.status for g in got] == ["COMMITTED"] * 2, got
                sim.ack(step)
                while core._background:  # retention runs in the background: let it finish
                    await asyncio.sleep(0.005)
        sim.phase(None)

    run(go())
    return 2


def checkpointer_run(sim: PowerLoss, job: Path) -> int:
    """A Checkpointer with its embedded coordinator: staged saves in the background; the
    odd steps over a small staging budget, so part of the shard is written before save()
    returns (the over-budget path)."""
    for step in STEPS:
        sim.phase(step)
        budget = 8192 if step % 2 else None
        with ckpt.Checkpointer(job, keep_last=KEEP, staging_budget_bytes=budget) as cp:
            cp.save(make_state(step, 0, step), step, metadata={"seed": step}).wait()
            sim.ack(step)
    sim.phase(None)
    return 1


RUNS = {"client": client_run, "coordinator": coordinator_run, "checkpointer": checkpointer_run}


def image_problems(
    img: Image, job_img: Path, world: int, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """What is wrong with one crash image (empty: the invariant holds)."""
    problems: list[str] = []
    steps = ckfmt.list_steps(open_storage(str(job_img))) if job_img.is_dir() else []
    problems += [
        f"step {s.step}: torn manifest ({s.error})" for s in steps if s.status == "INVALID"
    ]
    committed = [s.step for s in steps if s.status == "COMMITTED"]
    st = open_storage(str(job_img)) if committed else None
    for s in committed:
        assert st is not None
        rep = ckfmt.verify_checkpoint(st, s, level="full")
        if not rep.ok:
            problems.append(f"step {s} is committed but not whole: {rep.problems[:2]}")
    acked = img.acked[-1] if img.acked else None
    allowed = {x for x in (acked, img.saving) if x is not None}
    newest = committed[-1] if committed else None
    if acked is not None and acked not in committed:
        problems.append(f"step {acked} was acknowledged but is gone (committed: {committed})")
    if newest is not None and newest not in allowed:
        problems.append(f"newest committed step {newest} is neither of {sorted(allowed)}")
    if newest is not None and not problems:
        try:
            assert_loads(job_img, newest, newest, world, monkeypatch)
        except (AssertionError, CkptError) as e:
            problems.append(f"step {newest} does not load bit-exactly: {e}")
    return problems


def record(run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PowerLoss, int]:
    monkeypatch.delenv("CKPTD_ADDRESS", raising=False)
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "catalogs"))  # SQLite: not modelled
    disk = tmp_path / "disk"
    sim = PowerLoss(disk)
    with sim.recording(monkeypatch):
        world = RUNS[run_name](sim, disk / "job")
    return sim, world


def crash_images(sim: PowerLoss) -> list[Image]:
    """The distinct crash states of the run (equal trees at equal progress checked once)."""
    seen: set[object] = set()
    out = []
    for img in sim.images:
        key = (frozenset(reachable(img, sim.kind).items()), img.saving, img.acked[-1:])
        if key not in seen:
            seen.add(key)
            out.append(img)
    return out


def check_all(
    sim: PowerLoss,
    world: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tally,
    kind: str | None,
) -> dict[int, list[str]]:
    """{image seq: problems} over every crash image; each image tallied as one power cut."""
    found: dict[int, list[str]] = {}
    for i, img in enumerate(crash_images(sim)):
        dest = tmp_path / f"after-{i:03d}"
        materialize(img, sim.kind, str(dest))
        if kind is None:
            problems = image_problems(img, dest / "job", world, monkeypatch)
        else:
            with tally.fault(kind):
                problems = image_problems(img, dest / "job", world, monkeypatch)
                assert not problems, (
                    f"power cut after op {img.seq} (saving {img.saving}, acknowledged {img.acked}): {problems}\nops: {sim.log[max(0, img.seq - 12) : img.seq]}"
                )
        if problems:
            found[img.seq] = problems
    return found


@pytest.mark.parametrize("run_name", list(RUNS))
@pytest.mark.timeout(120)
def test_power_loss_at_every_fsync_keeps_the_invariant(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    sim, world = record(run_name, tmp_path, monkeypatch)
    assert not sim.pending or sim.saving is None
    # The run did what the test claims: retention retired steps and a shard was recycled.
    assert any("rename" in op and ".ckptd/recycle" in op.split("->")[0] for op in sim.log), sim.log
    assert not [a for a in sim.adopted if "/step-" in a], sim.adopted  # all of ckptd's writes seen
    check_all(sim, world, tmp_path, monkeypatch, tally, "power-loss")
    assert len(crash_images(sim)) > 4 * len(STEPS), len(crash_images(sim))


# fsync_dir call sites whose removal loses an acknowledged checkpoint: the simulator must say
# so. write_atomic's makes the manifest (and each index) durable; makedirs_durable's the job
# and step directories. (LocalWriteHandle.finish's is not among them: the index, written
# next into the same directory, fsyncs it again; remove_tree's and rename's guard only
# retired files, whose loss at a power cut loses nothing committed.)
SITES = ["write_atomic", "makedirs_durable"]


@pytest.mark.parametrize("site", SITES)
@pytest.mark.timeout(120)
def test_power_loss_catches_a_missing_directory_fsync(
    site: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    real = local.fsync_dir
    skipped: list[str] = []

    def fsync_dir(path: str) -> None:
        if sys._getframe(1).f_code.co_name == site:
            skipped.append(path)  # the bug under test: this call site forgot it
            return
        real(path)

    with tally.fault("power-loss:missing-dir-fsync(caught)"):
        monkeypatch.setattr(local, "fsync_dir", fsync_dir)
        sim, world = record("client", tmp_path, monkeypatch)
        monkeypatch.setattr(local, "fsync_dir", real)
        assert skipped, f"no fsync_dir call from {site} was made: the test removed nothing"
        found = check_all(sim, world, tmp_path, monkeypatch, tally, None)
        assert found, f"removing the directory fsync in {site} went unnoticed by the simulator"
        assert any("acknowledged" in p or "not whole" in p for ps in found.values() for p in ps), (
            found
        )


def test_the_model_drops_what_was_not_made_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator itself: unsynced data, an unsynced create and an unsynced rename are lost."""
    disk = tmp_path / "disk"
    st = local.LocalStorage(str(disk / "j"), create=True)
    sim = PowerLoss(disk)  # what is there now counts as durable
    with sim.recording(monkeypatch):
        fd = local.os.open(str(disk / "j" / "a"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"hello")
        local.os.fsync(fd)  # data durable, the name is not (j not fsynced)
        os.write(fd, b" world")  # never fsynced
        local.os.close(fd)
        local.fsync_dir(str(disk / "j"))  # now the name is durable too
        st.write_atomic("c", b"durable")  # tmp, fsync, rename, fsync dir
        local.os.rename(str(disk / "j" / "a"), str(disk / "j" / "b"))  # not durable
        fd = local.os.open(str(disk / "j" / "d"), os.O_WRONLY | os.O_CREAT, 0o644)
        local.os.fsync(fd)  # its bytes are durable, its name never is
        local.os.close(fd)
    after_first_fsync = tmp_path / "early"
    materialize(sim.images[1], sim.kind, str(after_first_fsync))
    assert os.listdir(after_first_fsync / "j") == []
    last = sim.images[-1]
    dest = tmp_path / "after"
    materialize(last, sim.kind, str(dest))
    assert sorted(os.listdir(dest / "j")) == ["a", "c"]
    assert (dest / "j" / "a").read_bytes() == b"hello"
    assert (dest / "j" / "c").read_bytes() == b"durable"
    assert sim.adopted == []
