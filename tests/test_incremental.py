"""Incremental saves: unchanged entries borrow an earlier committed step's bytes.

Real files, the real writer, reader, retention and ckptctl. Each test saves a LoRA-like
state (a frozen part that never changes, a small part that changes every step) with
`Checkpointer(incremental=True)` and checks what reached storage (ckptd.storage.counters),
that every committed step still verifies and loads bit-identical, and that retention and
gc keep what a kept step borrows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_testutil import edit_index, edit_manifest, flip_bit, read_json, tensor_raw
from coordinator_fixtures import ckptctl, ckptctl_json, wait_for

import ckpt
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint, InvalidManifest, UnsafePath
from ckptd.format import checkpoint as ckfmt
from ckptd.format import manifest as mf
from ckptd.format import writer
from ckptd.storage import counters, open_storage


def frozen() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}": torch.randn(128, 256, generator=g) for i in range(4)}  # 4 x 128 KiB


def state(step: int, base: dict[str, torch.Tensor] | None = None) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "base": base if base is not None else frozen(),
        "lora": {"A": torch.randn(8, 256, generator=g), "B": torch.randn(128, 8, generator=g)},
        "step": step,
    }


def blank() -> dict:
    z = {k: torch.zeros_like(v) for k, v in frozen().items()}
    return {"base": z, "lora": {"A": torch.zeros(8, 256), "B": torch.zeros(128, 8)}, "step": -1}


def same(a: dict, b: dict) -> bool:
    ta = [*a["base"].values(), *a["lora"].values()]
    tb = [*b["base"].values(), *b["lora"].values()]
    return a["step"] == b["step"] and all(
        tensor_raw(x) == tensor_raw(y) for x, y in zip(ta, tb, strict=True)
    )


def loads_as(job: Path, step: int, want: dict) -> None:
    got = blank()
    res = ckpt.load(got, str(job), step=step, fallback=False)
    assert res.step == step and same(got, want), f"step {step} does not load bit-identical"


def committed(job: Path) -> list[int]:
    return ckfmt.committed_steps(open_storage(str(job)))[::-1]


BASE_BYTES = 4 * 128 * 256 * 4


def test_unchanged_entries_are_borrowed_not_written(tmp_path: Path) -> None:
    job = tmp_path / "job"
    written = []
    with ckpt.Checkpointer(job, incremental=True) as c:
        for step in (1, 2, 3):
            before = counters.snapshot()
            r = c.save(state(step), step, blocking=True).wait()
            assert r is not None
            written.append((counters.snapshot() - before).written_bytes)
            if step > 1:
                assert r.borrowed_bytes == BASE_BYTES
    assert written[0] >= BASE_BYTES
    # Only the adapters (8 KiB + 4 KiB, each padded to 4 KiB) reached storage.
    assert written[1] == written[2] == 12288, written
    st = open_storage(str(job))
    for step in (1, 2, 3):
        loads_as(job, step, state(step))
        assert ckfmt.verify_checkpoint(st, step).ok
    m3 = ckfmt.read_manifest(st, 3)
    assert m3.borrows == [1]  # references never chain: step 3 names step 1's file, not 2's
    doc = read_json(job / "step-000000000003" / "MANIFEST.json")
    assert doc["version"] == mf.BORROWING_VERSION
    files = {
        e["file"] for e in read_json(job / "step-000000000003/shards/rank-00000.json")["entries"]
    }
    assert files == {"shards/rank-00000.bin", "../step-000000000001/shards/rank-00000.bin"}


def test_a_full_save_is_unchanged_version_2(tmp_path: Path) -> None:
    """Saves that borrow nothing (incremental off, or the first one) stay version 2, so
    an older ckptd reads them; a step that borrows is version 3, and an older reader
    refuses it clearly rather than reading a shard without the borrowed bytes."""
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    ckpt.save(state(3), str(job / "full"), step=3)
    for d in (job / "step-000000000001", job / "full" / "step-000000000003"):
        doc = read_json(d / "MANIFEST.json")
        assert doc["version"] == 2 and all("borrows" not in s for s in doc["shards"])
        assert read_json(d / "shards/rank-00000.json")["version"] == 2


def test_an_older_reader_refuses_a_step_that_borrows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    monkeypatch.setattr(mf, "READ_VERSIONS", (1, 2))  # what ckptd before version 3 reads
    with tally.bad_input("incremental: a version-3 step read by an older ckptd"):
        with pytest.raises(InvalidManifest, match="version 3 is not supported.*upgrade ckptd"):
            ckfmt.open_checkpoint(open_storage(str(job)), 2)
    ckfmt.open_checkpoint(open_storage(str(job)), 1)  # a step that borrows nothing still reads


def test_a_changed_entry_is_written_whole(tmp_path: Path) -> None:
    job = tmp_path / "job"
    base = frozen()
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1, base), 1, blocking=True)
        base["layer2"][5, 5] += 1  # one element of one frozen tensor
        before = counters.snapshot()
        r = c.save(state(2, base), 2, blocking=True).wait()
        assert r is not None
        assert (counters.snapshot() - before).written_bytes == 12288 + 128 * 1024
        assert r.borrowed_bytes == BASE_BYTES - 128 * 1024
    loads_as(job, 2, state(2, base))


def test_retention_keeps_a_lender_and_frees_it_when_nothing_borrows(tmp_path: Path) -> None:
    job = tmp_path / "job"
    base = frozen()
    with ckpt.Checkpointer(job, incremental=True, keep_last=1) as c:
        for step in (1, 2, 3, 4):
            c.save(state(step, base), step, blocking=True)
        # 2 and 3 are retired (nothing borrows from them); 1 lends the base to 4.
        wait_for(lambda: committed(job) == [1, 4], 10, "retention after step 4")
        doc = ckptctl_json("inspect", str(job), "--step", "4")
        assert doc["borrowed_bytes"] == BASE_BYTES and doc["borrows"] == [1]
        assert doc["owned_bytes"] == 8 * 256 * 4 + 128 * 8 * 4
        rc, out, _ = ckptctl("list", str(job))
        assert rc == 0 and "abandoned" not in out  # a lender is on the live line
        for k in base:
            base[k] = base[k] + 1  # the base changes: step 5 writes it, borrows nothing
        c.save(state(5, base), 5, blocking=True)
        wait_for(lambda: committed(job) == [5], 10, "retention after step 5")
    assert not (job / "step-000000000001").exists()
    loads_as(job, 5, state(5, base))


def test_apply_retention_and_gc_never_remove_a_lender(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        for step in (1, 2, 3):
            c.save(state(step), step, blocking=True)
    st = open_storage(str(job))
    assert ckpt.apply_retention(st, 1) == [2]
    assert committed(job) == [1, 3]
    ckfmt.quarantine(st, 1, "test: a lender marked bad")
    doc = ckptctl_json("gc", str(job), "--quarantined", "--abandoned", "--keep-last", "1")
    assert doc["removed"] == [] and doc["held"] == [1]
    assert (job / "step-000000000001" / "MANIFEST.json").exists()
    loads_as(job, 3, state(3))


def test_keep_last_recycling_never_takes_a_lenders_file(tmp_path: Path) -> None:
    """Retired files go to the recycle pool and the next save overwrites one: never a file
    a kept step borrows from (the lender is never retired while it lends)."""
    job = tmp_path / "job"
    base = frozen()
    with ckpt.Checkpointer(job, incremental=True, keep_last=1) as c:
        for step in range(1, 8):
            c.save(state(step, base), step, blocking=True)
            want = min(step, 2)
            wait_for(lambda n=want: len(committed(job)) == n, 10, "retention")
            assert committed(job)[0] == 1
            for s in committed(job):
                loads_as(job, s, state(s, base))
    pool = job / ".ckptd" / "recycle"
    assert not any(p.name.startswith("000000000001-") for p in pool.iterdir())


def test_verify_restore_and_inspect_follow_borrows(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    doc = ckptctl_json("verify", str(job), "--step", "2")
    checked = doc["steps"][0]["bytes_checked"] if "steps" in doc else doc["bytes_checked"]
    assert checked >= BASE_BYTES
    out = tmp_path / "restored.safetensors"
    ckptctl_json("restore", str(job), "--step", "2", "--to", str(out), "--format", "safetensors")
    from safetensors.torch import load_file

    got = load_file(str(out))
    want = state(2)
    assert tensor_raw(got["base/layer0"]) == tensor_raw(want["base"]["layer0"])
    assert tensor_raw(got["lora/A"]) == tensor_raw(want["lora"]["A"])
    rc, text, _ = ckptctl("inspect", str(job), "--step", "2")
    assert rc == 0 and "borrows 512.00 KiB from step(s) 1" in text


# -- bad input ------------------------------------------------------------------------
@pytest.fixture
def two(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    return job


def _borrowed(doc: dict) -> dict:
    return next(e for e in doc["entries"] if e["file"].startswith("../"))


@pytest.mark.parametrize(
    "file",
    [
        "../../step-000000000001/shards/rank-00000.bin",
        "../step-000000000001/../../outside.bin",
        "../step-1/shards/rank-00000.bin",
        "../other/shards/rank-00000.bin",
        "../step-000000000001/MANIFEST.json",
        "/etc/passwd",
    ],
)
def test_a_borrow_that_escapes_the_job_is_refused(two: Path, file: str, tally) -> None:
    edit_index(two, 2, lambda d: _borrowed(d).__setitem__("file", file))
    with tally.bad_input(f"incremental: borrowed file {file}"):
        with pytest.raises((InvalidManifest, UnsafePath)) as ei:
            ckfmt.open_checkpoint(open_storage(str(two)), 2)
    assert "rank-00000.json" in str(ei.value) and "key 'base/" in str(ei.value)


def test_a_borrow_of_its_own_step_is_refused(two: Path, tally) -> None:
    edit_index(
        two,
        2,
        lambda d: _borrowed(d).__setitem__("file", "../step-000000000002/shards/rank-00000.bin"),
    )
    with tally.bad_input("incremental: a step borrowing from itself"):
        with pytest.raises(InvalidManifest, match="another step"):
            ckfmt.open_checkpoint(open_storage(str(two)), 2)


def test_borrows_the_manifest_does_not_list_are_refused(two: Path, tally) -> None:
    edit_manifest(two, 2, lambda m: m["shards"][0].__delitem__("borrows"))
    with tally.bad_input("incremental: an index borrowing what the manifest does not list"):
        with pytest.raises(InvalidManifest, match="manifest says rank 0 borrows from"):
            ckfmt.open_checkpoint(open_storage(str(two)), 2)


def test_a_borrow_from_a_step_that_is_not_committed(two: Path, tally) -> None:
    (two / "step-000000000001" / "MANIFEST.json").unlink()
    with tally.bad_input("incremental: the lender is not committed"):
        with pytest.raises(CheckpointNotFound) as ei:
            ckpt.load(blank(), str(two), step=2, fallback=False)
    msg = str(ei.value)
    assert "step 2 rank 0 key 'base/" in msg and "step 1" in msg and "not a committed" in msg
    assert str(two) in msg and "rank-00000.bin" in msg
    rep = ckfmt.verify_checkpoint(open_storage(str(two)), 2)
    assert not rep.ok and "not a committed step" in rep.problems[0]


def test_borrowed_bytes_that_fail_their_hash(two: Path, tally) -> None:
    e = next(
        x
        for x in read_json(two / "step-000000000001/shards/rank-00000.json")["entries"]
        if x["key"] == "base/layer1"
    )
    flip_bit(str(two / "step-000000000001/shards/rank-00000.bin"), e["offset"] + 100)
    with tally.bad_input("incremental: borrowed bytes that fail their hash"):
        with pytest.raises(CorruptCheckpoint) as ei:
            ckpt.load(blank(), str(two), step=2, fallback=False)
    msg = str(ei.value)
    assert "step-000000000001/shards/rank-00000.bin" in msg and "'base/layer1'" in msg
    rc, out, err = ckptctl("verify", str(two), "--step", "2")
    assert rc == 1 and "base/layer1" in out + err


def test_a_borrowed_range_outside_the_lenders_shard(two: Path, tally) -> None:
    edit_index(two, 2, lambda d: _borrowed(d).__setitem__("offset", 1 << 30))
    with tally.bad_input("incremental: a borrowed range past the lender's shard"):
        with pytest.raises(InvalidManifest, match="bytes 1073741824.*not a range"):
            ckfmt.open_checkpoint(open_storage(str(two)), 2)


def test_commit_refuses_when_the_lender_went_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """A save whose lender is removed while it runs (gc outside the coordinator, which
    cannot see the save) is not committed; the previous step stays whole."""
    job = tmp_path / "job"
    real = writer.ShardWriter.finish

    def finish(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        info = real(self, *a, **kw)
        if info.borrows:
            (job / "step-000000000001" / "MANIFEST.json").rename(tmp_path / "hidden")
        return info

    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        monkeypatch.setattr(writer.ShardWriter, "finish", finish)
        with tally.fault("incremental: the lender removed while a save borrows from it"):
            with pytest.raises(
                ckpt.CkptError, match="borrows bytes from step 1, which is no longer"
            ):
                c.save(state(2), 2, blocking=True)
    assert not (job / "step-000000000002" / "MANIFEST.json").exists()


def test_an_incremental_save_past_the_staging_budget(tmp_path: Path) -> None:
    """Over budget the entries are written from the tensors before save() returns (the
    layout fixed by then): what they borrow is decided before that too."""
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True, staging_budget_bytes=0) as c:
        c.save(state(1), 1, blocking=True)
        before = counters.snapshot()
        r = c.save(state(2), 2).wait()
        assert r is not None and r.borrowed_bytes == BASE_BYTES
        assert (counters.snapshot() - before).written_bytes == 12288
    loads_as(job, 2, state(2))


def test_a_mirror_holds_the_lenders_and_loads_from_them(tmp_path: Path) -> None:
    """Each committed step is copied to the mirror as it is (borrows included); the mirror
    holds the lenders first, its retention keeps them, and a load from it is bit-exact."""
    job, mirror = tmp_path / "job", tmp_path / "mirror"
    with ckpt.Checkpointer(job, incremental=True, mirror=str(mirror), mirror_keep_last=1) as c:
        for step in (1, 2, 3):
            c.save(state(step), step, blocking=True)
            assert c._mirror is not None and c._mirror.wait(60)
        assert not c._mirror.failures
    assert committed(mirror) == [1, 3]  # 2 retired there; 1 lends to 3
    loads_as(mirror, 3, state(3))
    assert ckfmt.verify_checkpoint(open_storage(str(mirror)), 3).ok


def test_mirror_step_copies_a_missing_lender_first(tmp_path: Path) -> None:
    from ckptd.format.mirror import mirror_step

    job, mirror = tmp_path / "job", tmp_path / "mirror"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    mirror_step(open_storage(str(job)), open_storage(str(mirror), create=True), 2)
    assert committed(mirror) == [1, 2]
    loads_as(mirror, 2, state(2))


def test_resume_lands_on_the_newest_step_through_its_borrows(tmp_path: Path) -> None:
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        for step in (1, 2, 3):
            c.save(state(step), step, blocking=True)
    got = blank()
    with ckpt.Checkpointer(job, incremental=True) as c:
        res = c.resume(got)
        assert res == 3 and same(got, state(3))
        # Saving on from a resumed step borrows from it (its parent), not from scratch.
        r = c.save(state(4), 4, blocking=True).wait()
        assert r is not None and r.borrowed_bytes == BASE_BYTES
    assert ckfmt.read_manifest(open_storage(str(job)), 4).borrows == [1]


def test_a_lender_the_device_cannot_read_is_not_quarantined(
    two: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """EIO on the lender's file may be transient: the borrowing step is skipped this time,
    never marked bad (the load policy reads the error's cause, which the borrowing
    step's context keeps)."""
    import errno

    from ckptd.errors import StorageError
    from ckptd.storage.base import ReadHandle
    from ckptd.storage.local import LocalStorage

    class Failing(ReadHandle):
        def __init__(self, h: ReadHandle):
            self.h, self.size, self.path = h, h.size, h.path

        def read(self, offset: int, length: int):  # noqa: ANN201
            raise StorageError(errno.EIO, f"read {self.path} at {offset} failed: EIO")

        def close(self) -> None:
            self.h.close()

    class EIOStorage(LocalStorage):
        def open_read(self, path: str, *, cold: bool = False) -> ReadHandle:
            h = super().open_read(path, cold=cold)
            return Failing(h) if path.startswith("step-000000000001/") else h

    monkeypatch.setattr(ckpt._api, "open_storage", lambda p, **kw: EIOStorage(str(p)))
    with tally.fault("incremental: EIO reading a lender's file"):
        with pytest.raises(ckpt.CkptError, match="EIO"):
            ckpt.load(blank(), str(two))
    st = open_storage(str(two))
    assert ckfmt.quarantine_reason(st, 2) is None and ckfmt.quarantine_reason(st, 1) is None
    monkeypatch.undo()
    loads_as(two, 2, state(2))
