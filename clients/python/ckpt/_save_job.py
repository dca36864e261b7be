"""One rank's save between its blocking part and its background part.

The blocking part (`SaveJob.stage`) copies what fits the staging budget into the reusable
host image; over budget, the leading entries (in shard order) that fit are staged and the
rest are written to the shard file straight from the caller's tensors before save()
returns (hashed as they are written), so save() blocks only for what does not fit. Those
bytes land in the file whichever rank the plan later asks to write them; when another
replica writes them, they are simply not in this shard's index. A budget of 0 writes
everything from the tensors: what a blocking save wants, since nothing runs meanwhile.

The background part hashes the staged entries, and once the coordinator has said which
chunks this rank writes, writes them from the image, fsyncs, indexes and verifies.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ckpt._flatten import Leaf
from ckpt._staging import HostImage, stage
from ckptd import knobs
from ckptd.coordinator.core import SaveRef
from ckptd.coordinator.planning import ChunkPlan
from ckptd.format.manifest import ShardInfo
from ckptd.format.writer import ShardWriter, ShardWriteStats, hash_items, plan_offsets
from ckptd.storage import Storage

VERIFY_LEVELS = ("full", "size")


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How a save is written and committed; validated when made.

    verify: "full" re-reads the shard bypassing the page cache and checks every block
        before the report; "size" checks presence and sizes (bytes are hashed as written).
    keep_last: the coordinator's retention after the commit (None: keep all).
    staging_budget_bytes: host memory a save may stage into (None: no limit).
    preallocate, io_threads: the shard writer's (None: the knobs' defaults).
    """

    verify: str = "full"
    keep_last: int | None = None
    staging_budget_bytes: int | None = None
    preallocate: bool | None = None
    io_threads: int | None = None

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
    """A staged save of one rank: its entries, their shard offsets and the host image."""

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
        align = self.alignment = knobs.get().alignment
        sizes = [leaf.nbytes for leaf in leaves]
        self.offsets, self.size = plan_offsets(sizes, align)
        budget = options.staging_budget_bytes
        n = len(leaves)
        if budget is not None and self.size > budget:
            n = 0
            while n < len(leaves) and _round_up(self.offsets[n] + sizes[n], align) <= budget:
                n += 1
        self.image, staged, _ = stage(leaves[:n], host, alignment=align)
        self.items = staged + [leaf.write_item(leaf.host_bytes()) for leaf in leaves[n:]]
        self.n_staged = n
        # Over the staging budget: the shard file is open and the entries past n_staged
        # are already written (with these block hashes).
        self.writer: ShardWriter | None = None
        self._overflow_digests: list[list[str]] = []
        self.overflow_write_s = 0.0  # time spent writing them, inside the blocking part
        if n < len(leaves):
            t0 = time.perf_counter()
            # A recycled file may be reused only when every byte of it is written: true
            # when nothing is staged (every entry is written here, padding included).
            self.writer = self._writer(recycle_ok=n == 0)
            self._overflow_digests = self.writer.write(self.items[n:], self.offsets[n:])
            self.overflow_write_s = time.perf_counter() - t0

    @property
    def step(self) -> int:
        return self.ref.step

    def digests(self) -> list[list[str]]:
        """The blake3 of every block of every entry (the staged ones hashed now)."""
        return hash_items(self.items[: self.n_staged]) + self._overflow_digests

    def plan(self, digests: list[list[str]]) -> list[ChunkPlan]:
        return ChunkPlan.of_items(self.items, digests)

    def write(
        self, assigned: list[int], digests: list[list[str]], stats: ShardWriteStats
    ) -> ShardInfo:
        """Write this rank's assigned chunks from the staged image; fsync, index, verify."""
        t0 = time.perf_counter()
        staged = [i for i in assigned if i < self.n_staged]
        writer = self.writer
        if writer is None:
            covered = sum(_round_up(self.items[i].data.nbytes, self.alignment) for i in assigned)
            writer = self.writer = self._writer(recycle_ok=covered == self.size)
        writer.write(
            [self.items[i] for i in staged],
            [self.offsets[i] for i in staged],
            image=self.image,
            digests=[digests[i] for i in staged],
        )
        stats.write_s = time.perf_counter() - t0 + self.overflow_write_s
        return writer.finish(
            [self.items[i] for i in assigned],
            [self.offsets[i] for i in assigned],
            [digests[i] for i in assigned],
            verify=self.options.verify,
            stats=stats,
        )

    def written_bytes(self, assigned: list[int]) -> int:
        return sum(self.items[i].data.nbytes for i in assigned)

    def abort(self) -> None:
        """Remove what this rank wrote before the coordinator planned the save."""
        if self.writer is not None:
            self.writer.abort()

    def _writer(self, *, recycle_ok: bool) -> ShardWriter:
        r = self.ref
        return ShardWriter(
            self.storage,
            job=r.job,
            step=r.step,
            rank=r.rank,
            world_size=r.world_size,
            generation=r.generation,
            size=self.size,
            recycle_ok=recycle_ok,
            preallocate=self.options.preallocate,
            io_threads=self.options.io_threads,
        )


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align
