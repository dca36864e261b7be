"""I/O errors from below the storage seam: what the kernel can answer, and what ckptd does.

test_errors.py injects faults above the seam (a faulty Storage wrapper, RLIMIT_FSIZE);
here they come from where the kernel would give them: the `os` calls of
ckptd.storage.local (fsync failing with EIO, pwritev/os.write writing fewer bytes than
asked) and a real 8 MiB tmpfs that fills up (ENOSPC). Each runs on both save paths: the
single-process one (ckpt.save writes its own manifest) and the coordinator one (a
Checkpointer with its embedded coordinator, which writes the manifest). Afterwards the
failed step is not committed and leaves no files, and the previous step verifies and
loads bit-exactly. Last, a shard deleted between its report and the commit: the
coordinator's commit-time check refuses to commit; deleted after that check (during the
manifest write), verify and load catch it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_testutil import DelegatingStorage, FaultyOs
from coordinator_fixtures import RankSim, new_core, run, started, step_files, wait_for
from crash_harness import assert_loads
from ranks.plain_rank import make_state

import ckpt
from ckptd import knobs
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import local, open_storage

PATHS = ["client", "coordinator"]


class Saver:
    """save(state, step) on one save path; raises what the save raised.

    The Checkpointer (and its storage, which reads the knobs) is made at the first save,
    so a test can set knobs around everything it does.
    """

    def __init__(self, path: str, job: Path):
        self.path, self.job = path, job
        self.cp: ckpt.Checkpointer | None = None

    def __call__(self, state: Any, step: int) -> Any:
        if self.path == "client":
            return ckpt.save(state, self.job, step=step, metadata={"seed": step})
        if self.cp is None:
            self.cp = ckpt.Checkpointer(self.job)
        return self.cp.save(state, step, metadata={"seed": step}).wait()

    def catalog_status(self, step: int) -> str:
        """The coordinator's word on `step` (the client path has no coordinator)."""
        if self.cp is None:
            return "no coordinator"
        for c in self.cp.client.list_checkpoints(self.cp.path):
            if c.step == step:
                return c.status
        return "absent"

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()


@pytest.fixture(params=PATHS)
def save(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CKPTD_ADDRESS", raising=False)
    # The catalog stays off the filesystem under test (the ENOSPC one is tiny).
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "catalogs"))
    s = Saver(request.param, job_of(tmp_path))
    try:
        yield s
    finally:
        s.close()


def job_of(tmp_path: Path) -> Path:
    return tmp_path / "fs" / "job"


def assert_not_committed(
    job: Path, step: int, prev: int, monkeypatch: pytest.MonkeyPatch, save: Saver | None = None
) -> None:
    """`step` failed: no manifest, no files left; `prev` is the newest, whole, bit-exact;
    the coordinator (if any) holds it ABORTED."""
    assert not (job / f"step-{step:012d}" / "MANIFEST.json").exists()
    if save is not None:
        assert save.catalog_status(step) in ("ABORTED", "no coordinator")
    # The coordinator path removes an aborted save's files in the background.
    wait_for(lambda: step_files(job, step) == [], 10, f"the failed step {step}'s files to go")
    st = open_storage(str(job))
    assert ckfmt.latest_step(st) == prev
    rep = ckfmt.verify_checkpoint(st, prev, level="full")
    assert rep.ok, rep.problems
    assert_loads(job, prev, prev, 1, monkeypatch)


# ----------------------------------------------------------------------------- fsync EIO

TARGETS = {
    "shard": lambda p: p.endswith(".bin"),
    "shard-directory": lambda p: p.endswith("/shards"),
    "index": lambda p: ".json.tmp." in p and "/shards/" in p,
    "manifest": lambda p: "MANIFEST.json.tmp." in p,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsync_eio_fails_the_save_and_is_never_retried(
    target: str, save, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    job = job_of(tmp_path)
    save(make_state(1, 0, 1), 1)
    match = TARGETS[target]
    failed: list[int | None] = []
    retried: list[str] = []

    def fsync(fd: int) -> None:
        p, which = fos.fd_path.get(fd, ""), fos.fd_open.get(fd)
        if which in failed:
            retried.append(p)  # after a failed fsync the kernel may have dropped the pages
        elif "step-000000000002" in p and match(p) and not failed:
            failed.append(which)
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)

    fos = FaultyOs(fsync=fsync)
    with tally.fault("eio-fsync"):
        monkeypatch.setattr(local, "os", fos)
        with pytest.raises(ckpt.CkptError) as ei:
            save(make_state(2, 0, 2), 2)
        monkeypatch.setattr(local, "os", os)
        assert failed, f"no fsync of a {target} file was made"
        assert not retried, f"fsync retried after EIO: {retried}"
        msg = str(ei.value)
        assert "step-000000000002" in msg or "step 2" in msg, msg
        assert "Input/output error" in msg and "nothing was committed" in msg, msg
        assert_not_committed(job, 2, 1, monkeypatch, save)


# ----------------------------------------------------------------------------- ENOSPC


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs at tmp_path/fs (mounted for the test, unmounted after)."""
    d = tmp_path / "fs"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for ENOSPC needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); ENOSPC needs a small fs")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_enospc_mid_write_fails_cleanly(
    small_fs: Path, save, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    job = job_of(tmp_path)
    save(make_state(1, 0, 1), 1)
    free = os.statvfs(small_fs).f_bfree
    big = {**make_state(2, 0, 2), "big": torch.randn(3 << 20)}  # 12 MiB into 8
    with tally.fault("enospc"):
        with pytest.raises(ckpt.StorageError) as ei:
            save(big, 2)
        assert ei.value.errno == errno.ENOSPC, ei.value
        msg = str(ei.value)
        assert "step-000000000002" in msg and "rank-00000" in msg, msg
        assert "filesystem is full" in msg, msg
        assert_not_committed(job, 2, 1, monkeypatch, save)
        # Its files are gone: the space is back (give or take a directory block or two).
        assert os.statvfs(small_fs).f_bfree >= free - 4
        save(make_state(3, 0, 3), 3)  # and the next save goes through
        assert ckfmt.latest_step(open_storage(str(job))) == 3


# ----------------------------------------------------------------------------- short writes


def _shorten(n: int, limit: int = 1000) -> int:
    return max(1, min(n, limit))


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_short_writes_are_completed_not_truncated(
    mode: str, save, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """pwritev/pwrite and os.write may write less than asked: the writer goes on from there.
    (O_DIRECT: a block at a time, as a kernel does when the disk fills up mid-call.)"""
    job = job_of(tmp_path)
    short: list[int] = []

    def pwritev(fd: int, views: Any, offset: int) -> int:
        data = b"".join(bytes(v) for v in views)
        n = _shorten(len(data))
        short.append(len(data) - n)
        return os.pwrite(fd, data[:n], offset)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        mv = memoryview(data)
        short.append(max(0, len(mv) - local.ALIGN))
        return os.pwrite(fd, mv[: local.ALIGN], offset)

    def write(fd: int, data: Any) -> int:
        n = _shorten(len(data), 97)
        short.append(len(data) - n)
        return os.write(fd, bytes(data[:n]))

    with knobs.override(direct_io=mode == "direct"):
        save(make_state(1, 0, 1), 1)
        with tally.fault("short-write"):
            calls = {"pwritev": pwritev} if mode == "buffered" else {"pwrite": pwrite}
            monkeypatch.setattr(local, "os", FaultyOs(write=write, **calls))
            save(make_state(2, 0, 2), 2)
            monkeypatch.setattr(local, "os", os)
            assert sum(1 for s in short if s > 0) > 3, short  # really cut short, many times
            st = open_storage(str(job))
            assert ckfmt.latest_step(st) == 2
            assert ckfmt.verify_checkpoint(st, 2).ok
            assert_loads(job, 2, 2, 1, monkeypatch)


@pytest.mark.parametrize("device", ["direct-unaligned", "buffered-zero"])
def test_short_write_that_cannot_complete_is_a_clear_error(
    device: str, save, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """An O_DIRECT write cut short mid-block (the rest cannot go on with O_DIRECT), or a
    device that takes nothing: the save fails naming the file, never commits a truncated
    shard, never spins."""
    job = job_of(tmp_path)
    seen: list[int] = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        seen.append(fd)
        return 100

    def pwritev(fd: int, views: Any, offset: int) -> int:
        seen.append(fd)
        return 0

    direct = device.startswith("direct")
    with knobs.override(direct_io=direct):
        save(make_state(1, 0, 1), 1)
        with tally.fault("short-write"):
            monkeypatch.setattr(
                local, "os", FaultyOs(**({"pwrite": pwrite} if direct else {"pwritev": pwritev}))
            )
            with pytest.raises(ckpt.StorageError) as ei:
                save(make_state(2, 0, 2), 2)
            monkeypatch.setattr(local, "os", os)
            assert seen, "the write path under test was not taken"
            msg = str(ei.value)
            assert "short write" in msg and "rank-00000" in msg, msg
            assert "step-000000000002" in msg, msg
            assert_not_committed(job, 2, 1, monkeypatch, save)


# ----------------------------------------------------------------------------- shard deleted


@pytest.mark.parametrize("victim", ["bin", "json"])
def test_shard_deleted_between_report_and_commit_is_not_committed(
    victim: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """Rank 0 reported; its shard (or index) disappears; rank 1's report completes the set.
    The coordinator checks every shard's presence and size before writing the manifest
    (promise 1), so the save aborts, naming the file, instead of committing a hole."""
    root = tmp_path / "root"
    job = root / "job"

    async def go() -> None:
        async with started(new_core(root)) as core:
            for step in (1, 2):
                sims = [RankSim(core, str(job), r, 2) for r in range(2)]
                for s in sims:
                    s.prepare(make_state(step, s.rank, step))
                await asyncio.gather(*(s.begin(step, metadata={"seed": step}) for s in sims))
                reports = [await s.write(step) for s in sims]
                assert (await sims[0].report(step, reports[0])).status == "OPEN"
                if step == 2:
                    gone = job / f"step-{step:012d}" / f"shards/rank-00000.{victim}"
                    gone.unlink()
                await sims[1].report(step, reports[1])
                st = await core.await_commit(sims[0].ref(step), 30)
                if step == 1:
                    assert st.status == "COMMITTED", st
                    continue
                assert st.status == "ABORTED", st
                assert "step 2" in st.reason and "rank 0" in st.reason, st.reason
                assert f"rank-00000.{victim}" in st.reason and "missing" in st.reason, st.reason
                # Durable before told: were it still COMMITTING, a coordinator dying now
                # would commit on restart the save the ranks were just told was aborted.
                rec = core.catalog.save("job", 2)
                assert rec is not None and rec.status == "ABORTED", rec
                while core._background:  # the aborted save's files are removed in the background
                    await asyncio.sleep(0.01)

    with tally.fault("shard-deleted-before-commit"):
        run(go())
        assert_not_committed_world(job, monkeypatch)


def assert_not_committed_world(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not (job / "step-000000000002" / "MANIFEST.json").exists()
    assert step_files(job, 2) == []
    st = open_storage(str(job))
    assert ckfmt.latest_step(st) == 1 and ckfmt.verify_checkpoint(st, 1).ok
    assert_loads(job, 1, 1, 2, monkeypatch)


def test_shard_deleted_during_commit_is_caught_by_verify_and_load_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """The limit of the commit-time check: a shard removed after it (here: while the
    manifest is being written) commits a step with a hole. Nothing can prevent that from
    inside ckptd; what must hold is that it is caught, not loaded: verify names the file,
    and a load of the newest step falls back to the previous one and quarantines it."""
    root = tmp_path / "root"
    job = root / "job"

    class DeletesBeforeManifest(DelegatingStorage):
        armed = False

        def write_atomic(self, path: str, data: bytes) -> None:
            if self.armed and path.endswith("MANIFEST.json"):
                os.unlink(job / "step-000000000002" / "shards" / "rank-00001.bin")
            self.inner.write_atomic(path, data)

    wrapped: list[DeletesBeforeManifest] = []

    def factory(p: str) -> Any:
        wrapped.append(DeletesBeforeManifest(open_storage(p, create=True)))
        return wrapped[-1]

    async def go() -> None:
        async with started(new_core(root, storage_factory=factory)) as core:
            for step in (1, 2):
                if wrapped:  # the core opens the job's storage at the first save
                    wrapped[0].armed = step == 2
                sims = [RankSim(core, str(job), r, 2) for r in range(2)]
                for s in sims:
                    s.prepare(make_state(step, s.rank, step))
                got = await asyncio.gather(*(s.save(step, metadata={"seed": step}) for s in sims))
                assert [g.status for g in got] == ["COMMITTED"] * 2, got

    with tally.fault("shard-deleted-during-commit"):
        run(go())
        assert wrapped and wrapped[0].armed
        st = open_storage(str(job))
        rep = ckfmt.verify_checkpoint(st, 2)
        assert not rep.ok and any("rank-00001.bin" in p for p in rep.problems), rep.problems
        for r in range(2):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv("WORLD_SIZE", "2")
            got = make_state(99, r, -1)
            res = ckpt.load(got, str(job))
            assert res.step == 1, res
            if r == 0:  # the first load finds the hole, falls back and quarantines step 2
                assert res.fell_back_from == 2, res
                assert "rank-00001.bin" in (res.fallback_reason or ""), res.fallback_reason
            # later loads skip the quarantined step
        assert ckfmt.quarantine_reason(st, 2) is not None
        assert_loads(job, 1, 1, 2, monkeypatch)
