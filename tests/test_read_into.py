"""Reads straight into the destination (ckptd.format.reader's `into`): the bytes land in the
caller's memory with no bounce copy, each block hashed in place; a corrupt block is zeroed
before the error, so it never stays in the caller's memory. Loads that make new tensors
make large ones page-aligned, so O_DIRECT reads land in them."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import ckpt
from ckptd import knobs
from ckptd.errors import HashMismatch
from ckptd.format import checkpoint as ckfmt
from ckptd.format.reader import read_entries
from ckptd.storage import open_storage


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _saved(job: str) -> tuple[dict[str, torch.Tensor], object, str, list]:
    g = torch.Generator().manual_seed(3)
    state = {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: three hash blocks
        "odd": torch.randn(1000, generator=g),  # not a whole page
    }
    ckpt.save(state, job, step=1, verify="size")
    storage = open_storage(job)
    ck = ckfmt.open_checkpoint(storage, 1)
    (shard,) = ck.manifest.shards
    entries = [ck.chunks[k][0].entry for k in ("big", "odd")]
    return state, storage, ck.shard_path(shard), entries


@pytest.mark.parametrize("direct_io", [True, False])
def test_read_into_lands_in_the_destination_without_the_sink(job, direct_io):
    state, storage, path, entries = _saved(job)
    with knobs.override(direct_io=direct_io):
        storage = open_storage(job)
        outs = [_aligned(e.length) for e in entries]
        calls: list[int] = []
        problems = read_entries(
            storage,
            path,
            entries,
            knobs.get().block_size,
            sink=lambda i, start, data: calls.append(i),
            into=outs,
        )
    assert problems == []
    assert calls == []  # every entry was read in place, none copied through the sink
    for key, out in zip(("big", "odd"), outs, strict=True):
        assert out.tobytes() == state[key].numpy().tobytes()


def test_unaligned_destination_goes_through_the_sink(job):
    state, storage, path, entries = _saved(job)
    big = entries[0]
    buf = _aligned(big.length + 64)
    out = buf[64 : 64 + big.length]  # off the page: O_DIRECT cannot read into it
    got = np.zeros(big.length, dtype=np.uint8)

    def sink(i: int, start: int, data: np.ndarray) -> None:
        got[start : start + data.nbytes] = data

    with knobs.override(direct_io=True):
        storage = open_storage(job)
        handle = storage.open_read(path, cold=True)
        direct = getattr(handle, "direct", False)
        handle.close()
        if not direct:
            pytest.skip("this filesystem refuses O_DIRECT")
        read_entries(storage, path, [big], knobs.get().block_size, sink=sink, into=[out])
    assert got.tobytes() == state["big"].numpy().tobytes()
    assert not out.any()  # nothing was read into the unaligned destination


def test_corrupt_block_read_in_place_is_zeroed_and_raises(job, tally):
    state, storage, path, entries = _saved(job)
    big = entries[0]
    block = knobs.get().block_size
    full = storage.local_path(path)
    with open(full, "r+b") as f:  # flip a byte in the second block
        f.seek(big.offset + block + 123)
        b = f.read(1)
        f.seek(big.offset + block + 123)
        f.write(bytes([b[0] ^ 0xFF]))
    out = _aligned(big.length)
    with tally.fault("corrupt:block-read-in-place"):
        with pytest.raises(HashMismatch, match="block 1"):
            read_entries(storage, path, [big], block, into=[out])
    assert not out[block : 2 * block].any()  # the corrupt block did not stay
    want = state["big"].numpy().view(np.uint8)
    assert out[:block].tobytes() == want[:block].tobytes()  # its verified neighbour did


def test_load_into_empty_makes_large_tensors_page_aligned(job):
    state = {"big": torch.randn(1 << 19), "small": torch.randn(10)}
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job).state
    assert out["big"].data_ptr() % 4096 == 0
    assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
    out["big"].add_(1)  # writable, an ordinary tensor to the caller
    assert out["big"].untyped_storage().nbytes() == state["big"].nbytes
