"""One rank's save between its blocking part and its background part.

The blocking part (`SaveJob.__init__`) copies what fits the staging budget into the
reusable host image (laid out like a shard of every entry the rank holds); over budget,
the leading entries (in shard order) that fit are staged and the rest stay in the
caller's tensors. The shard file is packed (format version 2): it holds only the chunks
the coordinator assigns to this rank, so where an entry goes in it is known only from the
plan. Hence over budget the Checkpointer plans before save() returns: it hashes every
entry (the staged ones in the image, the rest in the tensors), calls BeginSave (which waits
for every rank) and `write_overflow` writes the assigned entries past the budget from the
tensors; an entry another replica writes is never written here. save() then blocks for
the hashing and the barrier as well as those writes: the price of a budget, paid only
when the state does not fit it. A budget of 0 writes everything from the tensors: what a
blocking save wants, since nothing runs meanwhile.

The background part hashes the staged entries (within budget), plans, and writes the
assigned staged entries from the image to their packed places (`write`), fsyncs,
indexes and verifies. One rank alone (`may_write_ahead`) writes before it plans instead:
every entry it holds is its own, so the packed layout is the image's, and `write_ahead`
writes the shard under a private name while hashing it (one pass over the bytes; on a
disk that overwrites a recycled file at 3-5 GB/s the separate hash pass had cost as much
as the writes) and returns once the hashes are known, so the plan is made while its last
writes are in flight; `keep_ahead` waits for them and renames the file into place once
the plan is accepted.

An incremental save (SaveOptions.incremental) is given, before the layout is fixed, what
its base (the step it descends from) holds for this rank (`borrow_from`): of an assigned
entry, every block whose hash equals the same block of the base's entry of the same key
and box is not written, and the index entry borrows it from the step that holds it
(ckptd.format.incremental); the packed file holds only the changed blocks, each run of
them a write unit (`units`) at its packed place. An entry with no changed block borrows
whole (format version 3 when one lender's file holds it in one run).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ckpt._flatten import Leaf
from ckpt._staging import HostImage, stage
from ckptd import knobs
from ckptd.coordinator.core import SaveRef
from ckptd.coordinator.planning import ChunkPlan
from ckptd.format import layout
from ckptd.format.incremental import borrow_key, reuse_blocks
from ckptd.format.manifest import IndexEntry, ShardInfo, entry_pieces, own_part
from ckptd.format.writer import (
    ShardWriter,
    ShardWriteStats,
    WriteItem,
    hash_items,
    memory_phases,
    plan_offsets,
)
from ckptd.storage import Storage

VERIFY_LEVELS = ("full", "size")
log = logging.getLogger("ckpt")


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How a save is written and committed; validated when made.

    verify: "full" re-reads the shard bypassing the page cache and checks every block
        before the report; "size" checks presence and sizes (bytes are hashed as written).
    keep_last: the coordinator's retention after the commit (None: keep all).
    staging_budget_bytes: host memory a save may stage into (None: no limit).
    preallocate, io_threads: the shard writer's (None: the knobs' defaults).
    incremental: write only the entries whose bytes changed since the step the save
        descends from; the others borrow that step's bytes (docs/format.md, Borrowed
        entries). Retention keeps a step while a kept step borrows from it.
    """

    verify: str = "full"
    keep_last: int | None = None
    staging_budget_bytes: int | None = None
    preallocate: bool | None = None
    io_threads: int | None = None
    incremental: bool = False

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(f"verify must be 'full' or 'size', got {self.verify!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (the newest checkpoint is always kept), "
                f"got {self.keep_last}"
            )
        if self.staging_budget_bytes is not None and self.staging_budget_bytes < 0:
            raise ValueError(f"staging_budget_bytes must be >= 0, got {self.staging_budget_bytes}")
        if self.io_threads is not None and self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")


class SaveJob:
    """A staged save of one rank: its entries, their place in the host image and, once
    the coordinator has planned, in the packed shard file."""

    def __init__(
        self,
        storage: Storage,
        ref: SaveRef,
        node: Any,
        metadata: dict[str, Any],
        options: SaveOptions,
        leaves: list[Leaf],
        host: HostImage,
    ):
        self.storage, self.ref, self.options = storage, ref, options
        self.node, self.metadata = node, metadata
        self.host = host  # the image staged into (a one-off one is released after the save)
        align = self.alignment = knobs.get().alignment
        sizes = [leaf.nbytes for leaf in leaves]
        self.held_bytes = sum(sizes)
        self.image_offsets, image_size = plan_offsets(sizes, align)
        budget = options.staging_budget_bytes
        n = len(leaves)
        if budget is not None and image_size > budget:
            n = 0
            while n < len(leaves) and _round_up(self.image_offsets[n] + sizes[n], align) <= budget:
                n += 1
        self.image, staged, _ = stage(leaves[:n], host, alignment=align)
        self.items = staged + [leaf.write_item(leaf.host_bytes()) for leaf in leaves[n:]]
        self.n_staged = n
        # Set by the plan: the entries this rank writes, wholly or partly (in image order),
        # the byte ranges of them it writes (units: (entry, start, end), in file order) and
        # the units' packed offsets in the shard file of `size` bytes.
        self.assigned: list[int] | None = None
        self.units: list[tuple[int, int, int]] = []
        self.offsets: list[int] = []
        self.size = 0
        self.writer: ShardWriter | None = None
        # An incremental save's base entries (incremental.borrowable), the assigned entries
        # that borrow all their blocks instead of being written, and those that borrow some
        # (by image position; for `split`, the index entry and its units' first and count).
        self.base: dict[tuple[Any, ...], IndexEntry] = {}
        self.borrowed: dict[int, IndexEntry] = {}
        self.split: dict[int, tuple[IndexEntry, int, int]] = {}
        self.overflow_write_s = 0.0  # writing entries past the budget, in the blocking part
        self.ahead = False  # every entry written (and hashed) before the plan: write_ahead
        self._ahead_t0 = 0.0

    @property
    def step(self) -> int:
        return self.ref.step

    @property
    def over_budget(self) -> bool:
        """Entries past the staging budget: they must be written before save() returns."""
        return self.n_staged < len(self.items)

    def digests(self) -> list[list[str]]:
        """The blake3 of every block of every entry (the staged ones from the image)."""
        return hash_items(self.items)

    def may_write_ahead(self, world_size: int) -> bool:
        """Whether this save can write its shard before the plan (write_ahead): one rank
        holds every entry (no replica to deduplicate), nothing is borrowed (an incremental
        save's layout needs the digests first), the storage renames a file in place cheaply
        (supports_reuse), and no staged entry would be written in the blocking part (over
        budget, all or nothing)."""
        return (
            world_size == 1
            and bool(self.items)
            and not self.options.incremental
            and self.storage.supports_reuse
            and (self.n_staged in (0, len(self.items)))
        )

    def write_ahead(self) -> list[list[str]]:
        """Write every entry to its place in the shard, hashing each block as it goes (one
        pass over the bytes, where digests() and then write() were two), under a private
        name; returns the digests for the plan. keep_ahead() then keeps the file if the
        plan is the layout it was written in, else removes it. Nothing is committed before
        finish() has made it durable and verified it, as for any shard."""
        n = len(self.items)
        self._assign(list(range(n)))  # one rank, nothing borrowed: the image's layout
        self._ahead_t0 = time.perf_counter()
        self.writer = self._open(ahead=True)
        # The staged entries, then the rest: in order, so the digests are the writes' own
        # lists one after another (no placeholder list a tensor, which Python's collector
        # would count through the save).
        digests: list[list[str]] = []
        staged = list(range(self.n_staged))
        over = list(range(self.n_staged, n))
        for which, image in ((staged, True), (over, False)):
            if which:
                # Back with the hashes while the last writes are still in flight: the plan
                # is made meanwhile, and keep_ahead waits for them.
                digests += self._write(which, image, None, wait=False)
        self.ahead = True
        return digests

    def keep_ahead(self, assigned: list[int]) -> None:
        """After the plan: keep the file write_ahead wrote when the coordinator assigned
        every entry (renamed to the shard's name), else remove it and write the plan's
        layout as usual."""
        assert self.writer is not None and self.assigned is not None
        if sorted(assigned) == self.assigned:
            self.writer.publish()  # once the writes are done
            self.overflow_write_s = time.perf_counter() - self._ahead_t0
            return
        self.writer.abort()
        self.writer, self.assigned, self.offsets, self.size = None, None, [], 0
        self.units = []
        self.ahead = False
        self.overflow_write_s = 0.0

    def plan(self, digests: list[list[str]]) -> list[ChunkPlan]:
        return ChunkPlan.of_items(self.items, digests)

    def borrow_from(self, base: dict[tuple[Any, ...], IndexEntry]) -> None:
        """The base's entries an incremental save may borrow (before the layout is fixed)."""
        if self.assigned is not None:
            raise RuntimeError("the shard's layout is already fixed")
        self.base = base

    def write_overflow(self, assigned: list[int], digests: list[list[str]]) -> None:
        """Over budget, before save() returns: write the assigned entries past the budget
        from the caller's tensors to their packed places."""
        if self.ahead:
            return
        t0 = time.perf_counter()
        over = [k for k, u in enumerate(self._assign(assigned, digests)) if u[0] >= self.n_staged]
        self._write(over, False, digests)
        self.overflow_write_s = time.perf_counter() - t0

    def write(
        self, assigned: list[int], digests: list[list[str]], stats: ShardWriteStats
    ) -> ShardInfo:
        """Write this rank's assigned staged entries from the image; fsync, index, verify."""
        t0 = time.perf_counter()
        units = self._assign(assigned, digests)
        if not self.ahead:
            self._write([k for k, u in enumerate(units) if u[0] < self.n_staged], True, digests)
        stats.write_s = time.perf_counter() - t0 + self.overflow_write_s
        assert self.writer is not None
        info = self.writer.finish(
            [self._unit_item(u) for u in units],
            self.offsets,
            [self._unit_digests(u, digests) for u in units],
            verify=self.options.verify,
            stats=stats,
            borrowed=[self.borrowed[i] for i in sorted(self.borrowed)],
            split=[(first, count, e) for e, first, count in self.split.values()],
        )
        log.debug(
            "%s: written (%d bytes): write %.3f s, verify %.3f s (%s)",
            self.writer.ctx,
            info.size,
            stats.write_s,
            stats.verify_s,
            self.options.verify,
        )
        return info

    def shard_size(self, assigned: list[int], digests: list[list[str]] | None = None) -> int:
        """The packed shard file's size once `assigned` are its entries (fixes the layout)."""
        self._assign(assigned, digests)
        return self.size

    def written_bytes(self, assigned: list[int]) -> int:
        """Tensor bytes this rank wrote of `assigned` (only the changed blocks of an entry
        that borrows the others)."""
        wanted = set(assigned)
        return sum(end - start for i, start, end in self.units if i in wanted)

    @property
    def borrowed_bytes(self) -> int:
        block = knobs.get().block_size
        split = 0
        for e, _, _ in self.split.values():
            own = own_part(e, block)
            split += e.length - (own.length if own is not None else 0)
        return sum(e.length for e in self.borrowed.values()) + split

    def abort(self) -> None:
        """Remove what this rank wrote before the save was committed or aborted."""
        if self.writer is not None:
            self.writer.abort()

    def _assign(
        self, assigned: list[int], digests: list[list[str]] | None = None
    ) -> list[tuple[int, int, int]]:
        """The units this rank writes of the plan's entries, in image order, and their packed
        layout (so with nothing deduplicated or borrowed the file is laid out exactly like
        the image). Of an entry the base holds, the blocks with the same hashes are
        borrowed instead (an incremental save)."""
        if self.assigned is None:
            block = knobs.get().block_size
            # A borrowed block's offset in its lender's file must be aligned, as an entry's.
            blocks_ok = block % self.alignment == 0
            own_file = layout.shard_name(self.ref.rank, self.ref.generation)
            if self.base and digests is not None:
                for i in assigned:
                    it = self.items[i]
                    old = self.base.get(borrow_key(it))
                    new = None if old is None else reuse_blocks(old, digests[i], block, own_file)
                    if new is None or (new.borrowed_blocks and not blocks_ok):
                        continue
                    new.stats = it.stats
                    if own_part(new, block) is None:
                        self.borrowed[i] = new
                    else:
                        self.split[i] = (new, 0, 0)
            self.assigned = sorted(i for i in assigned if i not in self.borrowed)
            self.units = []
            for i in self.assigned:
                n = self.items[i].data.nbytes
                if i not in self.split:
                    self.units.append((i, 0, n))
                    continue
                e = self.split[i][0]
                first = len(self.units)
                for p in entry_pieces(e, block):
                    if p.file == own_file:  # a run of changed blocks
                        self.units.append((i, p.start, p.start + p.length))
                self.split[i] = (e, first, len(self.units) - first)
            # Where each unit's memory lies in its page, where the storage writes straight
            # from such memory (a staged unit's is 0: the image is page-aligned).
            phases, least = None, self.storage.phased_from
            if least is not None and knobs.get().phased_layout:
                items = [self._unit_item(u) for u in self.units]
                phases = memory_phases(items, self.alignment, least)
            self.offsets, self.size = plan_offsets(
                [end - start for _, start, end in self.units], self.alignment, phases
            )
        return self.units

    def _whole(self, unit: tuple[int, int, int]) -> bool:
        """Whether the unit is its entry's every byte (not a run of changed blocks)."""
        i, start, end = unit
        return start == 0 and end == self.items[i].data.nbytes

    def _unit_item(self, unit: tuple[int, int, int]) -> WriteItem:
        i, start, end = unit
        it = self.items[i]
        if self._whole(unit):
            return it
        return dataclasses.replace(it, data=it.data[start:end], stats=None)

    def _unit_digests(self, unit: tuple[int, int, int], digests: list[list[str]]) -> list[str]:
        i, start, end = unit
        if self._whole(unit):
            return digests[i]  # its list, not a copy (nothing changes it in place)
        block = knobs.get().block_size
        return digests[i][start // block : -(-end // block)]

    def _write(
        self, which: list[int], image: bool, digests: list[list[str]] | None, *, wait: bool = True
    ) -> list[list[str]]:
        """Write the units at positions `which` of the packed order (hashing them as they
        are written when `digests` is None); their digests. wait=False: ShardWriter.write's."""
        if self.writer is None:
            self.writer = self._open()
        units = [self.units[k] for k in which]
        return self.writer.write(
            [self._unit_item(u) for u in units],
            [self.offsets[k] for k in which],
            image=self.image if image else None,
            image_offsets=[self.image_offsets[i] + start for i, start, _ in units]
            if image
            else None,
            digests=None if digests is None else [self._unit_digests(u, digests) for u in units],
            wait=wait,
        )

    def _open(self, *, ahead: bool = False) -> ShardWriter:
        r = self.ref
        return ShardWriter(
            self.storage,
            job=r.job,
            step=r.step,
            rank=r.rank,
            world_size=r.world_size,
            generation=r.generation,
            size=self.size,
            preallocate=self.options.preallocate,
            io_threads=self.options.io_threads,
            verify=self.options.verify,
            ahead=ahead,
        )


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align
