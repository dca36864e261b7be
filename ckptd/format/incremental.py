"""What an incremental save borrows: the base's entries, and which blocks of each.

A save with `incremental=True` reads its base's index of the same rank (`borrowable`),
each entry naming the files that hold its bytes as a sibling step sees them, and, for each
entry it is assigned, keeps the blocks whose hashes changed and borrows the others
(`reuse_blocks`): a run of unchanged blocks stored one after another in one lender's file
is one reference (docs/format.md, Version 4: borrowed blocks). Where an entry's bytes are
is `manifest.entry_pieces`; references never chain, since a borrowed block is named by the
file that holds it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ckptd import knobs
from ckptd.errors import CkptError
from ckptd.format import layout
from ckptd.format.checkpoint import quarantine_reason, read_index, read_manifest
from ckptd.format.manifest import BlockRun, IndexEntry, entry_pieces
from ckptd.storage.base import Storage


def borrowable(storage: Storage, step: int | None, rank: int) -> dict[tuple[Any, ...], IndexEntry]:
    """What an incremental save of `rank` may borrow from committed `step` (its base): the
    entries of that step's shard of the same rank, by (key, dtype, shape, chunk offsets and
    sizes), each naming the files that hold its bytes as a sibling step sees them (a
    borrowed entry or block names its lender's file: references never chain). Empty when
    `step` is None, not committed, quarantined, or written with another block size; only the
    same rank's index is read (a save of stable layout writes each chunk from the same rank
    every step)."""
    if step is None:
        return {}
    try:
        m = read_manifest(storage, step)
        if quarantine_reason(storage, step) is not None or m.block_size != knobs.get().block_size:
            return {}
        shard = next((s for s in m.shards if s.rank == rank), None)
        if shard is None:
            return {}
        index = read_index(storage, m, shard, max_entries=knobs.get().max_entries_per_shard)
    except CkptError:
        return {}  # no base: the save writes everything
    out: dict[tuple[Any, ...], IndexEntry] = {}
    for e in index.entries:
        lent = copy.copy(e)  # every field the entry has: what they say of the bytes holds
        if layout.split_borrowed(e.file) is None:
            lent.file = layout.borrowed_file(step, e.file)
        out[borrow_key(e)] = lent
    return out


def block_sources(e: IndexEntry, block: int) -> list[tuple[str, int]]:
    """(file, offset) of every block of entry `e` (manifest.entry_pieces, block by block)."""
    out: list[tuple[str, int]] = []
    for p in entry_pieces(e, block):
        out += [(p.file, p.offset + i * block) for i in range(len(p.blake3))]
    return out


def reuse_blocks(
    old: IndexEntry, digests: list[str], block: int, own_file: str
) -> IndexEntry | None:
    """An entry of `digests` that borrows every block equal to `old`'s (an entry of the
    base, as `borrowable` gives it) and holds the others in `own_file` (at an offset the
    caller sets); None when no block is equal. Runs of neighbouring blocks stored one after
    another in one lender's file become one run; an entry all of whose blocks are one run
    borrows the entry whole (format version 3, not 4)."""
    if len(old.blake3) != len(digests):
        return None
    same = [a == b for a, b in zip(old.blake3, digests, strict=True)]
    if not any(same):
        return None
    src = block_sources(old, block)
    runs: list[BlockRun] = []
    for b, (file, off) in enumerate(src):
        if not same[b]:
            continue
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.block + last.count == b
            and last.file == file
            and last.offset + last.count * block == off
        ):
            runs[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            runs.append(BlockRun(b, 1, file, off))
    new = copy.copy(old)
    new.blake3 = list(digests)
    if len(runs) == 1 and runs[0].count == len(digests):
        new.file, new.offset, new.borrowed_blocks = runs[0].file, runs[0].offset, ()
        return new
    new.file, new.offset, new.borrowed_blocks = own_file, 0, runs
    return new


def borrow_key(e: Any) -> tuple[Any, ...]:
    """What must be equal for a chunk to borrow an earlier step's entry (besides its
    bytes' block hashes): key, dtype, global shape and the box."""
    return (e.key, e.dtype, tuple(e.shape), tuple(e.chunk_offsets), tuple(e.chunk_sizes))
