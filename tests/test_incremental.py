"""Incremental saves: unchanged entries borrow an earlier committed step's bytes.

Real files, the real writer, reader, retention and ckptctl. Each test saves a LoRA-like
state (a frozen part that never changes, a small part that changes every step) with
`Checkpointer(incremental=True)` and checks what reached storage (ckptd.storage.counters),
that every committed step still verifies and loads bit-identical, and that retention and
gc keep what a kept step borrows.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_testutil import (
    as_older_ckptd,
    edit_index,
    edit_manifest,
    flip_bit,
    read_json,
    tensor_raw,
)
from coordinator_fixtures import ckptctl, ckptctl_json, spawn_ranks, wait_for
from ranks import shared_read_worker

import ckpt
from ckpt import _shared_read as sr
from ckptd import knobs
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint, InvalidManifest, UnsafePath
from ckptd.format import checkpoint as ckfmt
from ckptd.format import diff, hashing, writer
from ckptd.format import manifest as mf
from ckptd.format.boxes import BoxRead, plan_boxes, read_boxes
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
    refuses it clearly rather than reading a shard without the borrowed bytes. (A one-shot
    save from the tensors' own memory is version 5 where phased_layout is on:
    test_phased_layout.py.)"""
    job = tmp_path / "job"
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(state(1), 1, blocking=True)
        c.save(state(2), 2, blocking=True)
    with knobs.override(phased_layout=False):
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
    as_older_ckptd(monkeypatch, (1, 2))  # what ckptd before version 3 reads
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


# -- block granularity ------------------------------------------------------------------
# A 64 KiB hash block (CKPT_BLOCK_SIZE) so that a 1 MiB embedding table is 16 blocks of 64
# rows each: a few changed rows change a few blocks, and only those reach storage.
BLOCK = 64 * 1024
ROWS, DIM = 1024, 256  # float32: 1 KiB a row, 64 rows a block
ROWS_PER_BLOCK = BLOCK // (DIM * 4)


@pytest.fixture
def small_blocks():

    with knobs.override(block_size=BLOCK):
        yield


def table(seed: int = 3) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def touch(emb: torch.Tensor, rows: list[int], step: int) -> torch.Tensor:
    """A copy of the table with `rows` changed (what one batch's sparse update does)."""
    out = emb.clone()
    out[rows] += float(step)
    return out


def emb_state(emb: torch.Tensor, step: int) -> dict:
    # "tail" is 70 rows: its last block is partial (6 rows), a case of its own.
    return {"emb": emb, "tail": emb[: ROWS_PER_BLOCK + 6].clone() * 2, "step": step}


def emb_blank() -> dict:
    return {"emb": torch.zeros(ROWS, DIM), "tail": torch.zeros(ROWS_PER_BLOCK + 6, DIM), "step": -1}


def emb_loads_as(job: Path, step: int, want: dict) -> None:
    got = emb_blank()
    res = ckpt.load(got, str(job), step=step, fallback=False)
    assert res.step == step and got["step"] == want["step"]
    for k in ("emb", "tail"):
        assert tensor_raw(got[k]) == tensor_raw(want[k]), f"step {step} key {k} differs"


def entry(job: Path, step: int, key: str) -> dict:
    doc = read_json(job / f"step-{step:012d}/shards/rank-00000.json")
    return next(e for e in doc["entries"] if e["key"] == key)


def blocks_of(rows: list[int]) -> set[int]:
    return {r // ROWS_PER_BLOCK for r in rows}


@pytest.fixture
def emb_job(tmp_path: Path, small_blocks) -> tuple[Path, dict[int, dict]]:
    """Steps 1..3 of an embedding table: 1 is full; 2 changes rows in blocks 0 and 10; 3
    changes a row of block 3 and the tail's partial last block."""
    job = tmp_path / "job"
    emb = table()
    states = {1: emb_state(emb, 1)}
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save(states[1], 1, blocking=True)
        emb = touch(emb, [5, 700], 2)
        states[2] = emb_state(emb, 2)
        states[2]["tail"] = states[1]["tail"]
        c.save(states[2], 2, blocking=True)
        emb = touch(emb, [200], 3)
        tail = states[2]["tail"].clone()
        tail[ROWS_PER_BLOCK + 3] += 1  # the partial last block
        states[3] = {"emb": emb, "tail": tail, "step": 3}
        c.save(states[3], 3, blocking=True)
    return job, states


def test_only_the_changed_blocks_of_an_entry_reach_storage(tmp_path: Path, small_blocks) -> None:
    """A few rows of a large embedding table change: only their blocks are written, the
    index entry borrows every other block from the step that holds it."""
    job = tmp_path / "job"
    emb = table()
    with ckpt.Checkpointer(job, incremental=True) as c:
        c.save({"emb": emb}, 1, blocking=True)
        rows = [5, 6, 700, 1023]  # blocks 0, 10, 15
        emb2 = touch(emb, rows, 2)
        before = counters.snapshot()
        r = c.save({"emb": emb2}, 2, blocking=True).wait()
        assert r is not None
        written = (counters.snapshot() - before).written_bytes
    assert written == len(blocks_of(rows)) * BLOCK == 3 * BLOCK
    assert r.bytes == 3 * BLOCK and r.borrowed_bytes == (16 - 3) * BLOCK
    e = entry(job, 2, "emb")
    lender = "../step-000000000001/shards/rank-00000.bin"
    assert e["file"] == "shards/rank-00000.bin" and e["offset"] == 0
    assert e["borrowed_blocks"] == [
        [1, 9, lender, 1 * BLOCK],
        [11, 4, lender, 11 * BLOCK],
    ]
    assert (job / "step-000000000002/shards/rank-00000.bin").stat().st_size == 3 * BLOCK
    # The index and the manifest are version 4 (an older reader would misread the entry).
    assert read_json(job / "step-000000000002/shards/rank-00000.json")["version"] == 4
    assert read_json(job / "step-000000000002/MANIFEST.json")["version"] == 4
    assert ckfmt.read_manifest(open_storage(str(job)), 2).borrows == [1]
    for step, want in ((1, emb), (2, emb2)):
        got = {"emb": torch.zeros(ROWS, DIM)}
        ckpt.load(got, str(job), step=step, fallback=False)
        assert tensor_raw(got["emb"]) == tensor_raw(want)
    assert ckfmt.verify_checkpoint(open_storage(str(job)), 2).ok


def test_block_references_never_chain(emb_job: tuple[Path, dict[int, dict]]) -> None:
    """Step 3 borrows blocks that step 1 holds from step 1 and those step 2 wrote from
    step 2: every reference names the step whose file holds the bytes."""
    job, states = emb_job
    e = entry(job, 3, "emb")
    s1 = "../step-000000000001/shards/rank-00000.bin"
    s2 = "../step-000000000002/shards/rank-00000.bin"
    runs = e["borrowed_blocks"]
    assert {b for b, n, _, _ in runs for b in range(b, b + n)} == set(range(16)) - {3}
    by_block = {b + i: (f, off + i * BLOCK) for b, n, f, off in runs for i in range(n)}
    assert by_block[0][0] == by_block[10][0] == s2  # written by step 2
    assert by_block[1][0] == by_block[15][0] == s1  # never written since step 1
    for b, (f, off) in by_block.items():  # the lender's own bytes, never its references
        lender = int(f.split("step-")[1][:12])
        lent = entry(job, lender, "emb")
        if lender == 1:
            assert off == lent["offset"] + b * BLOCK
        else:
            assert not any(rb <= b < rb + n for rb, n, _, _ in lent["borrowed_blocks"])
    tail = entry(job, 3, "tail")  # 2 blocks: the first borrowed, the partial last written
    assert tail["borrowed_blocks"] == [[0, 1, s1, entry(job, 1, "tail")["offset"]]]
    assert ckfmt.read_manifest(open_storage(str(job)), 3).borrows == [1, 2]
    for step, want in states.items():
        emb_loads_as(job, step, want)
        assert ckfmt.verify_checkpoint(open_storage(str(job)), step).ok


def test_resharding_loads_read_across_block_references(
    emb_job: tuple[Path, dict[int, dict]],
) -> None:
    """Boxes of a block-borrowing entry (rows across several pieces; a column slice, so
    strided) read bit-identical, and only the blocks they need."""

    job, states = emb_job
    ck = ckfmt.open_checkpoint(open_storage(str(job)), 3)
    pieces = ck.pieces(ck.chunks["emb"][0].entry)  # in three files: 1's, 2's and its own
    assert len(pieces) == 6 and len({f for f, _ in pieces}) == 3
    want = states[3]["emb"]
    for rows, cols in (((30, 700), (0, DIM)), ((150, 100), (10, 50)), ((0, ROWS), (0, DIM))):
        out = torch.zeros(rows[1], cols[1])
        buf = out.view(torch.uint8).reshape(-1).numpy()
        read = read_boxes(ck, [BoxRead("emb", [rows[0], cols[0]], [rows[1], cols[1]], buf)])
        part = want[rows[0] : rows[0] + rows[1], cols[0] : cols[0] + cols[1]]
        assert tensor_raw(out) == tensor_raw(part), (rows, cols)
        first, last = rows[0] // ROWS_PER_BLOCK, (rows[0] + rows[1] - 1) // ROWS_PER_BLOCK
        assert read == (last - first + 1) * BLOCK
    # A load into a table of another shape is refused as usual; into the same, exact.
    emb_loads_as(job, 3, states[3])


def test_the_shared_read_plan_names_borrowed_blocks_by_their_lenders_file(
    emb_job: tuple[Path, dict[int, dict]],
) -> None:
    """The plan ranks exchange (ckpt._shared_read) names stored bytes by (file, offset):
    a block-borrowing entry's pieces are planned, read and applied from the files that
    hold them, bit-identical (the plan of one rank, read by itself)."""

    job, states = emb_job
    ck = ckfmt.open_checkpoint(open_storage(str(job)), 3)
    out = torch.zeros(ROWS, DIM)
    plan = plan_boxes(
        ck, [BoxRead("emb", [0, 0], [ROWS, DIM], out.view(torch.uint8).reshape(-1).numpy())]
    )
    said = [sr.Announce(sr._READY, needs=sr.needs_of(plan, BLOCK))]
    pieces = sr.make_pieces(ck, said, BLOCK, 4 * BLOCK)
    files = {ck.files[p.shard] for p in pieces}
    assert files == {f"step-00000000000{k}/shards/rank-00000.bin" for k in (1, 2, 3)}
    assert sum(p.nbytes for p in pieces) == ROWS * DIM * 4
    for p in pieces:
        p.reader = 0
    bufs = {id(p): np.empty(p.nbytes, dtype=np.uint8) for p in pieces}
    assert sr._read_mine(ck, pieces, bufs, 0, None) is None
    sinks = sr._local_sinks(plan)
    for p in pieces:
        assert sr._check_received(ck, p, bufs[id(p)], BLOCK) is None
        sr._apply(sinks, p, bufs[id(p)])
    assert tensor_raw(out) == tensor_raw(states[3]["emb"])


def test_diff_export_and_inspect_follow_block_references(
    emb_job: tuple[Path, dict[int, dict]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    job, states = emb_job
    st = open_storage(str(job))
    ck = ckfmt.open_checkpoint(st, 3)
    # The logical digest (what diff reads when two steps' layouts differ) reads every piece.
    report = diff.DiffReport(2, 3, [])
    raw = states[3]["emb"].contiguous().numpy().view(np.uint8)
    assert diff._logical_digest(ck, "emb", report, None) == hashing.digest(raw.data)
    assert report.bytes_read == ROWS * DIM * 4
    got = {k.key: k.status for k in diff.diff_checkpoints(st, 2, 3).keys}
    assert got["emb"] == got["tail"] == diff.CHANGED
    out = tmp_path / "restored.safetensors"
    ckptctl_json("restore", str(job), "--step", "3", "--to", str(out), "--format", "safetensors")
    got = load_file(str(out))  # a self-contained copy
    assert tensor_raw(got["emb"]) == tensor_raw(states[3]["emb"])
    assert tensor_raw(got["tail"]) == tensor_raw(states[3]["tail"])
    doc = ckptctl_json("inspect", str(job), "--step", "3")
    emb = next(t for t in doc["tensors"] if t["key"] == "emb")
    assert emb["borrowed_bytes"] == 15 * BLOCK and emb["borrowed_blocks"] == 15
    assert emb["borrowed_from"] == [1, 2]
    assert doc["borrowed_bytes"] == 15 * BLOCK + BLOCK  # emb's 15 and tail's first block
    assert doc["owned_bytes"] == BLOCK + 6 * DIM * 4
    rc, text, _ = ckptctl("inspect", str(job), "--step", "3")
    assert rc == 0 and "960.00 KiB (15 blocks) from step 1, 2" in text


def test_a_flipped_bit_in_a_lenders_block_is_caught(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    """Block 12 of step 3's table lies in step 1's file: a flipped bit there fails step 3's
    load and verify naming the lender's file, the key and the block; step 3's own blocks
    are untouched."""
    job, _ = emb_job
    lender = job / "step-000000000001/shards/rank-00000.bin"
    flip_bit(str(lender), entry(job, 1, "emb")["offset"] + 12 * BLOCK + 77)
    with tally.bad_input("incremental: a flipped bit in a block a later step borrows"):
        with pytest.raises(CorruptCheckpoint) as ei:
            ckpt.load(emb_blank(), str(job), step=3, fallback=False)
    msg = str(ei.value)
    assert "step 3 borrows bytes from step-000000000001/shards/rank-00000.bin" in msg
    assert "key 'emb' block 12 " in msg
    rep = ckfmt.verify_checkpoint(open_storage(str(job)), 3)
    assert not rep.ok and "key 'emb' block 12 " in rep.problems[0]
    assert "step-000000000001/shards/rank-00000.bin" in rep.problems[0]
    rc, out, err = ckptctl("verify", str(job), "--step", "2")
    assert rc == 1 and "block 12" in out + err  # step 2 borrows it too


def test_a_flipped_bit_in_a_changed_block_names_the_steps_own_file(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    job, _ = emb_job
    own = job / "step-000000000003/shards/rank-00000.bin"
    flip_bit(str(own), entry(job, 3, "emb")["offset"] + 5)  # block 3, written by step 3
    with tally.bad_input("incremental: a flipped bit in a step's own changed block"):
        with pytest.raises(CorruptCheckpoint) as ei:
            ckpt.load(emb_blank(), str(job), step=3, fallback=False)
    assert "step-000000000003/shards/rank-00000.bin: key 'emb' block 3 " in str(ei.value)


def _runs(doc: dict) -> list:
    return next(e for e in doc["entries"] if e["key"] == "emb")["borrowed_blocks"]


@pytest.mark.parametrize(
    ("case", "edit", "match"),
    [
        (
            "escapes the job",
            lambda r: r[0].__setitem__(2, "../../step-000000000001/shards/x.bin"),
            "another step|\\.\\.",
        ),
        ("absolute path", lambda r: r[0].__setitem__(2, "/etc/passwd"), "another step"),
        ("through ..", lambda r: r[0].__setitem__(2, "../step-000000000001/../../x.bin"), "\\.\\."),
        (
            "not a shard",
            lambda r: r[0].__setitem__(2, "../step-000000000001/MANIFEST.json"),
            "another step",
        ),
        (
            "its own step",
            lambda r: r[0].__setitem__(2, "../step-000000000003/shards/rank-00000.bin"),
            "another step",
        ),
        ("overlapping runs", lambda r: r[1].__setitem__(0, r[0][0]), "ascending, disjoint"),
        ("past the entry", lambda r: r[-1].__setitem__(1, 99), "ascending, disjoint"),
        ("no blocks", lambda r: r[0].__setitem__(1, 0), "ascending, disjoint"),
        ("unaligned", lambda r: r[0].__setitem__(3, r[0][3] + 1), "aligned"),
        ("past the lender", lambda r: r[0].__setitem__(3, 1 << 30), "not a range"),
        ("a bad run", lambda r: r.__setitem__(0, [0, 1, "x"]), "must be \\[first block"),
        ("a bool", lambda r: r[0].__setitem__(1, True), "must be \\[first block"),
    ],
    ids=lambda x: x if isinstance(x, str) and " " in x or x == "unaligned" else "",
)
def test_a_bad_block_reference_is_refused(
    emb_job: tuple[Path, dict[int, dict]], case: str, edit, match: str, tally
) -> None:
    job, _ = emb_job
    edit_index(job, 3, lambda d: edit(_runs(d)))
    with tally.bad_input(f"incremental: a block reference that {case}"):
        with pytest.raises((InvalidManifest, UnsafePath)) as ei:
            ckpt.load(emb_blank(), str(job), step=3, fallback=False)
    msg = str(ei.value)
    assert re.search(match, msg), msg
    # Names the job, the step, the rank's index (or rank), the key.
    assert str(job) in msg and "step 3" in msg or "step-000000000003" in msg
    assert "rank-00000.json" in msg or "rank 0" in msg
    assert "'emb'" in msg


def test_two_entries_borrowing_one_range_are_refused(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    job, _ = emb_job

    def edit(d: dict) -> None:
        tail = next(e for e in d["entries"] if e["key"] == "tail")
        emb_run = _runs(d)[0]
        tail["borrowed_blocks"][0][2:] = emb_run[2:]  # the tail borrows emb's bytes

    edit_index(job, 3, edit)
    with tally.bad_input("incremental: two entries borrowing one range"):
        with pytest.raises(InvalidManifest, match="borrowed by another entry") as ei:
            ckfmt.open_checkpoint(open_storage(str(job)), 3)
    assert "step 3 rank 0 key" in str(ei.value) and str(job) in str(ei.value)


def test_block_references_in_an_older_index_version_are_refused(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    job, _ = emb_job
    edit_index(job, 3, lambda d: d.__setitem__("version", 3))
    with tally.bad_input("incremental: borrowed_blocks in a version-3 index"):
        with pytest.raises(InvalidManifest, match="borrows blocks, which format version 3"):
            ckfmt.open_checkpoint(open_storage(str(job)), 3)


def test_a_version_4_index_under_a_version_3_manifest_is_refused(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    """The manifest's version bounds its indexes': one set back (so that an older ckptd
    would read the step and misjudge it) is refused, naming the index and the step."""
    job, _ = emb_job
    edit_manifest(job, 3, lambda m: m.__setitem__("version", 3))
    with tally.bad_input("incremental: a version-4 index under a version-3 manifest"):
        with pytest.raises(InvalidManifest, match="format version 4, but the manifest of step 3"):
            ckfmt.open_checkpoint(open_storage(str(job)), 3)


def test_a_block_lender_the_manifest_does_not_list_is_refused(
    emb_job: tuple[Path, dict[int, dict]], tally
) -> None:
    job, _ = emb_job
    edit_manifest(job, 3, lambda m: m["shards"][0].__setitem__("borrows", [1]))
    with tally.bad_input("incremental: a block lender missing from the manifest's borrows"):
        with pytest.raises(InvalidManifest, match="manifest says rank 0 borrows from \\[1\\]"):
            ckfmt.open_checkpoint(open_storage(str(job)), 3)


def test_an_older_reader_refuses_an_index_with_block_references(
    emb_job: tuple[Path, dict[int, dict]], monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """An older ckptd lists the step as unreadable (its manifest is version 4), so a load
    skips it without judging it corrupt (no quarantine) and retention keeps what it may
    borrow; a step that borrows only whole entries stays version 3 for it."""
    job, _ = emb_job
    as_older_ckptd(monkeypatch, (1, 2, 3))  # ckptd before version 4
    with tally.bad_input("incremental: a version-4 step read by an older ckptd"):
        with pytest.raises(InvalidManifest, match="version 4 is not supported.*upgrade ckptd"):
            ckfmt.open_checkpoint(open_storage(str(job)), 3)
    st = open_storage(str(job))
    listed = {s.step: s.status for s in ckfmt.list_steps(st)}
    assert listed == {1: ckfmt.COMMITTED, 2: ckfmt.INVALID, 3: ckfmt.INVALID}
    got = emb_blank()
    assert ckpt.load(got, str(job)).step == 1  # the newest step it can read
    assert ckfmt.quarantine_reason(st, 3) is None and ckfmt.quarantine_reason(st, 2) is None


def test_retention_and_gc_keep_every_block_lender(tmp_path: Path, small_blocks) -> None:
    """keep_last=1: each step borrows blocks from the steps that wrote them, so those stay,
    and what they borrow from (transitively: 4 borrows from 1 and 3, 3 from 1 and 2); gc
    keeps them too; a save that changes every block frees them all."""
    job = tmp_path / "job"
    emb = table()
    states: dict[int, torch.Tensor] = {}
    with ckpt.Checkpointer(job, incremental=True, keep_last=1) as c:
        for step, rows in ((1, []), (2, [0]), (3, [100]), (4, [0])):
            emb = touch(emb, rows, step) if rows else emb
            states[step] = emb
            c.save({"emb": emb}, step, blocking=True)
        # 4: block 0 written, block 1 from 3, the rest from 1; 3: block 0 from 2.
        st = open_storage(str(job))
        assert ckfmt.read_manifest(st, 4).borrows == [1, 3]
        assert ckfmt.read_manifest(st, 3).borrows == [1, 2]
        _settle(c)
        assert committed(job) == [1, 2, 3, 4]
        doc = ckptctl_json("gc", str(job), "--keep-last", "1")
        assert doc["removed"] == [] and sorted(doc["held"]) == [1, 2, 3]
        for step in (1, 2, 3, 4):
            got = {"emb": torch.zeros(ROWS, DIM)}
            ckpt.load(got, str(job), step=step, fallback=False)
            assert tensor_raw(got["emb"]) == tensor_raw(states[step])
        emb = emb + 1
        c.save({"emb": emb}, 5, blocking=True)
        wait_for(lambda: committed(job) == [5], 10, "retention after step 5")
    got = {"emb": torch.zeros(ROWS, DIM)}
    ckpt.load(got, str(job), fallback=False)
    assert tensor_raw(got["emb"]) == tensor_raw(emb)


def _settle(c: ckpt.Checkpointer) -> None:
    """Wait for the embedded coordinator's background work (retention after a commit)."""
    core = c._conn.embedded.core if c._conn.embedded is not None else None
    if core is not None:
        wait_for(lambda: not core._background, 20, "the coordinator's background retention")


def test_a_partial_save_past_the_staging_budget(tmp_path: Path, small_blocks) -> None:
    """Over budget the changed blocks are written from the tensors before save() returns."""
    job = tmp_path / "job"
    emb = table()
    with ckpt.Checkpointer(job, incremental=True, staging_budget_bytes=0) as c:
        c.save({"emb": emb}, 1, blocking=True)
        emb2 = touch(emb, [64, 65, 900], 2)  # blocks 1 and 14
        before = counters.snapshot()
        r = c.save({"emb": emb2}, 2).wait()
        assert r is not None and r.borrowed_bytes == 14 * BLOCK
        assert (counters.snapshot() - before).written_bytes == 2 * BLOCK
    got = {"emb": torch.zeros(ROWS, DIM)}
    ckpt.load(got, str(job), step=2, fallback=False)
    assert tensor_raw(got["emb"]) == tensor_raw(emb2)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_four_ranks_share_a_load_of_borrowed_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four gloo ranks save step 2 incrementally with a few elements changed, then load it
    with the shared read plan: every stored byte (the lender's blocks and the step's own)
    is read from storage once for the job, and every rank's values are bit-exact."""
    monkeypatch.setenv("CKPT_BLOCK_SIZE", str(BLOCK))
    world, job, out = 4, tmp_path / "job", tmp_path / "out"
    out.mkdir()

    def run(mode: str) -> list[dict]:
        spawn_ranks(
            shared_read_worker.entry,
            world,
            lambda r, port: (r, world, port, mode, str(job), str(out)),
            out,
            log_name=lambda r: f"{shared_read_worker._name(mode)}-rank{r}.log",
            timeout=180,
        )
        name = shared_read_worker._name(mode)
        results = [read_json(str(out / f"{name}-rank{r}.json")) for r in range(world)]
        for res in results:
            assert not res.get("error"), res
            if mode.startswith("load"):
                assert res["checks"] and all(res["checks"].values()), res["checks"]
        return results

    run("save-rows")
    st = open_storage(str(job))
    ck = ckfmt.open_checkpoint(st, 2)
    split = {e.key for i in ck.indexes for e in i.entries if e.borrowed_blocks}
    assert {"rep.0", "rep.3", "half"} <= split, split
    assert ck.borrowed_bytes > 0 and ck.manifest.borrows == [1]
    stored = sum(p.length for _, p in ck.stored())
    loaded = run("load:auto:rows")
    assert all(r["result"]["step"] == 2 for r in loaded)
    assert sum(r["read_bytes"] for r in loaded) == stored
