"""Format version 5 (manifest.PHASED_VERSION), with CKPT_PHASED_LAYOUT=1 (off by default:
knobs.phased_layout says why): a save that writes tensors from their own memory under
O_DIRECT places each large entry in the file as its memory lies in its page, so the disk
takes the bytes straight from the tensor instead of through a bounce copy;
the manifest says version 5 (an older ckptd lists the step as unreadable, never judges it
corrupt); the packing rule of version 5 is checked like version 2's; loads read such
entries straight into tensors placed the same way."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_testutil import as_older_ckptd, edit_index, read_json
from coordinator_fixtures import TOKEN, ServerThread, finished

import ckpt
from ckptd import knobs
from ckptd.errors import InvalidManifest
from ckptd.format import checkpoint as ckfmt
from ckptd.format import manifest as mf
from ckptd.format.reader import read_entries
from ckptd.server import ServerOptions
from ckptd.storage import counters, local, open_storage

MiB = 1 << 20


@pytest.fixture(autouse=True)
def phased_layout():
    with knobs.override(phased_layout=True):
        yield


def _64_bytes_into_a_page(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory of its own that starts 64 bytes into a page, where torch's
    allocator usually puts a large tensor. Usually only: where a fresh 3 MiB tensor lands
    depends on what the process freed before (glibc raises its mmap threshold), and one
    that came page-aligned made the tests below prove nothing."""
    raw = np.empty(t.nbytes + 2 * 4096, dtype=np.uint8)
    at = (64 - raw.ctypes.data) % 4096
    out = torch.from_numpy(raw[at : at + t.nbytes]).view(t.dtype).view(t.shape)
    return out.copy_(t)


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Large tensors (64 bytes into a page), a middling one and a small one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": _64_bytes_into_a_page(torch.randn(3 * MiB // 4 + 5, generator=g)),  # 3 MiB and a bit
        "b": _64_bytes_into_a_page(torch.randn(1024, 1024, generator=g).bfloat16()),  # 2 MiB
        "c": torch.randn(MiB // 4 - 7, generator=g),  # just under 1 MiB: keeps its aligned place
        "small": torch.randn(10, generator=g),
    }


def _direct(job: str) -> bool:
    st = open_storage(job, create=True)
    st.write_atomic("probe.bin", b"\0" * 4096)
    handle = st.open_write("probe2.bin", 4096)
    direct = bool(getattr(handle, "direct", False))
    handle.abort()
    return direct


def _index(job: str, step: int) -> dict:
    d = Path(job) / f"step-{step:012d}"
    (shard,) = read_json(d / "MANIFEST.json")["shards"]
    return read_json(d / shard["index"])


def _entries(job: str, step: int) -> dict[str, dict]:
    return {e["key"]: e for e in _index(job, step)["entries"]}


def _version(job: str, step: int) -> tuple[int, int]:
    d = Path(job) / f"step-{step:012d}"
    return read_json(d / "MANIFEST.json")["version"], _index(job, step)["version"]


def test_the_default_layout_is_aligned_version_2(job):
    with knobs.override(phased_layout=knobs.Knobs().phased_layout):
        s = state()
        assert s["a"].data_ptr() % 4096 != 0  # else this test proves nothing
        ckpt.save(s, job, step=1)
        assert all(e["offset"] % 4096 == 0 for e in _entries(job, 1).values())
        assert _version(job, 1) == (2, 2)
        out = ckpt.load({}, job).state
        assert all(torch.equal(out[k], t) for k, t in s.items())


def test_a_job_saved_phased_goes_on_under_the_default(job):
    """Steps written as version 5 (the default before 2026-12-05) stay loadable, and an
    incremental save under the aligned default that borrows from one is version 5 itself
    (its entries name the lender's phased offsets), while what it writes anew is aligned."""
    s = state()
    ckpt.save(s, job, step=1)
    assert _version(job, 1) == (mf.PHASED_VERSION, mf.PHASED_VERSION)
    changed = {**s, "b": s["b"] + 1}
    with knobs.override(phased_layout=False):
        with ckpt.Checkpointer(job, incremental=True, staging_budget_bytes=0) as cp:
            finished(cp.save(changed, 2))
        got = _entries(job, 2)
        assert got["a"]["file"].startswith("../step-000000000001/")  # borrowed, phased
        assert got["a"]["offset"] % 4096 and got["b"]["offset"] % 4096 == 0  # b: written anew
        assert _version(job, 2) == (mf.PHASED_VERSION, mf.PHASED_VERSION)
        for step, want in ((1, s), (2, changed)):
            out = ckpt.load({}, job, step=step).state
            assert all(torch.equal(out[k], t) for k, t in want.items()), step
        report = ckfmt.verify_checkpoint(open_storage(job), 2, level="full")
        assert report.bytes_checked >= sum(t.nbytes for t in changed.values())


def test_large_entries_lie_in_the_file_as_their_memory_lies_in_its_page(job):
    s = state()
    ckpt.save(s, job, step=1, verify="full")
    got = _entries(job, 1)
    for key in ("a", "b"):
        assert got[key]["offset"] % 4096 == s[key].data_ptr() % 4096, key
    assert s["a"].data_ptr() % 4096 != 0  # else this test proves nothing
    assert got["c"]["offset"] % 4096 == 0 and got["small"]["offset"] % 4096 == 0
    assert _version(job, 1) == (mf.PHASED_VERSION, mf.PHASED_VERSION)
    size = (Path(job) / "step-000000000001" / _index(job, 1)["shard"]).stat().st_size
    assert size % 4096 == 0 and size < sum(t.nbytes for t in s.values()) + 4 * 4096
    out = ckpt.load({}, job).state
    for key, t in s.items():
        assert torch.equal(out[key], t), key
    into = {k: torch.zeros_like(t) for k, t in s.items()}
    assert ckpt.load(into, job).step == 1
    assert all(torch.equal(into[k], t) for k, t in s.items())
    report = ckfmt.verify_checkpoint(open_storage(job), 1, level="full")
    assert report.bytes_checked >= sum(t.nbytes for t in s.values())


def test_the_disk_takes_the_bytes_straight_from_the_tensors(job, monkeypatch):
    if not _direct(job):
        pytest.skip("this filesystem refuses O_DIRECT")
    copied = [0]
    copy = local.copy_into

    def counting(dst: np.ndarray, src: np.ndarray) -> None:
        copied[0] += src.nbytes
        copy(dst, src)

    monkeypatch.setattr(local, "copy_into", counting)
    s = state()
    large = s["a"].nbytes + s["b"].nbytes
    ckpt.save(s, job, step=1, verify="size")
    phased = copied[0]
    copied[0] = 0
    with knobs.override(phased_layout=False):
        ckpt.save(s, job, step=2, verify="size")
    assert _version(job, 2) == (2, 2)
    assert copied[0] >= large  # page-aligned offsets: every byte through the bounce buffer
    assert phased < copied[0] - large + 2 * 2 * 4096  # of a, b: a page at each end at most
    for step in (1, 2):
        out = ckpt.load({}, job, step=step).state
        assert all(torch.equal(out[k], t) for k, t in s.items())


def test_a_staged_save_keeps_aligned_offsets(job):
    """Checkpointer.save copies into its page-aligned staging image first: version 2."""
    s = state()
    with ckpt.Checkpointer(job) as cp:
        finished(cp.save(s, 1))
    assert _version(job, 1) == (2, 2)
    with ckpt.Checkpointer(job, staging_budget_bytes=0) as cp:  # from the tensors' memory
        finished(cp.save(s, 2))
    assert _version(job, 2) == (mf.PHASED_VERSION, mf.PHASED_VERSION)
    assert ckpt.load({}, job).step == 2


def test_the_version_reaches_the_manifest_over_grpc(tmp_path):
    server = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN))
    try:
        job = str(tmp_path / "root" / "job")
        s = state()
        with ckpt.Checkpointer(
            job, coordinator=server.address, token=TOKEN, staging_budget_bytes=0
        ) as cp:
            finished(cp.save(s, 1))
        assert _version(job, 1) == (mf.PHASED_VERSION, mf.PHASED_VERSION)
        out = ckpt.load({}, job).state
        assert all(torch.equal(out[k], t) for k, t in s.items())
    finally:
        server.stop()


def test_an_older_reader_lists_the_step_as_unreadable(job, monkeypatch, tally):
    s = state()
    with knobs.override(phased_layout=False):
        ckpt.save(s, job, step=1)
    ckpt.save(s, job, step=2)
    as_older_ckptd(monkeypatch, (1, 2, 3, 4))  # ckptd before version 5
    with tally.bad_input("phased layout: a version-5 step read by an older ckptd"):
        with pytest.raises(InvalidManifest, match="version 5 is not supported.*upgrade ckptd"):
            ckfmt.open_checkpoint(open_storage(job), 2)
    st = open_storage(job)
    assert {x.step: x.status for x in ckfmt.list_steps(st)} == {
        1: ckfmt.COMMITTED,
        2: ckfmt.INVALID,
    }
    assert ckpt.load({}, job).step == 1  # the newest step it can read
    assert ckfmt.quarantine_reason(st, 2) is None


def _first_large(doc: dict) -> dict:
    return min((e for e in doc["entries"] if e["key"] == "a"), key=lambda e: e["offset"])


@pytest.mark.parametrize(
    "edit, match",
    [
        # a phased offset in an index that says version 2
        (lambda d: d.__setitem__("version", 2), "not 4096-byte aligned"),
        # off the 64-byte grid
        (lambda d: _first_large(d).__setitem__("offset", _first_large(d)["offset"] + 8), "64-byte"),
        # a whole page or more past the end of the entry before
        (
            lambda d: _first_large(d).__setitem__("offset", _first_large(d)["offset"] + 4096),
            "not packed|overlaps|past the shard",
        ),
    ],
)
def test_a_version_5_index_is_checked(job, tally, edit, match):
    ckpt.save(state(), job, step=1)
    assert _entries(job, 1)["a"]["offset"] % 4096  # phased
    edit_index(job, 1, edit)
    with tally.bad_input("phased layout: an altered version-5 index"):
        with pytest.raises(InvalidManifest, match=match):
            ckfmt.open_checkpoint(open_storage(job), 1)


def test_plan_offsets_puts_each_entry_at_its_phase():
    from ckptd.format.writer import plan_offsets

    offsets, size = plan_offsets([5000, 10, 8192, 3], 4096, [64, 0, 4032, 128])
    assert offsets == [64, 8192, 12224, 20608]
    assert size == 24576
    ends = [o + n for o, n in zip(offsets, [5000, 10, 8192, 3], strict=True)]
    for before, off in zip([0, *ends], offsets, strict=False):
        assert before <= off < before + 4096
    assert plan_offsets([5000, 10], 4096) == ([0, 8192], 12288)  # version 2: aligned


def test_a_read_into_memory_placed_like_the_file_needs_no_sink(job):
    s = state()
    ckpt.save(s, job, step=1)
    st = open_storage(job)
    ck = ckfmt.open_checkpoint(st, 1)
    (shard,) = ck.manifest.shards
    entries = [ck.chunks[k][0].entry for k in ("a", "b")]
    outs = []
    for e in entries:
        phase = e.offset % 4096
        outs.append(np.frombuffer(mmap.mmap(-1, phase + e.length), dtype=np.uint8)[phase:])
    calls: list[int] = []
    before = counters.snapshot()
    problems = read_entries(
        st,
        ck.shard_path(shard),
        entries,
        knobs.get().block_size,
        sink=lambda i, start, data: calls.append(i),
        into=outs,
    )
    assert problems == [] and calls == []
    if _direct(job):  # neighbours in the file: one scatter read of both, the partial pages
        # at the ends (and the one they share) into scratch pages
        assert (counters.snapshot() - before).read_calls == 1
    for key, out in zip(("a", "b"), outs, strict=True):
        assert out.tobytes() == s[key].view(torch.uint8).numpy().tobytes()
