"""Shards written by the ranks of one save, committed from one process.

DCP gathers every rank's write results to one rank, and Lightning saves from rank 0
only; in both, one process runs ckptd's commit protocol with the coordinator on behalf of
every rank of the save: BeginSave with each rank's chunks and their blake3 (the
coordinator's barrier waits for all of them), ReportShard (the coordinator stats each
shard, checks its index blake3 and that it holds exactly the planned chunks), then
AwaitCommit. The shards themselves are written by ckptd's ShardWriter (aligned, blake3
per block, fsync, index, cold re-read with verify="full") wherever the bytes are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckpt._protocol import commit_for_ranks
from ckptd import knobs
from ckptd.coordinator import retention
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.format import checkpoint as ckfmt
from ckptd.format.manifest import ShardInfo
from ckptd.format.writer import ShardWriter, WriteItem, plan_offsets
from ckptd.server.client import CoordinatorClient
from ckptd.storage import Storage, open_storage


@dataclasses.dataclass(frozen=True)
class Target:
    """One rank's part of a save: where its shard goes and how it is checked."""

    job: str
    step: int
    generation: int
    rank: int
    world_size: int
    verify: str
    io_threads: int | None


def begin_step(storage: Storage, job: str, step: int) -> None:
    """Before any rank writes a shard of `step`: a quarantined copy of the step gives way
    (retention.make_way: a committed one refuses the save), an unfinished save's debris
    goes, and the directories are made."""
    retention.make_way(storage, step, where=f"job {job} step {step}")
    ckfmt.begin_step(storage, step)


def write_shard(target: Target, items: list[WriteItem]) -> tuple[ShardInfo, list[ChunkPlan]]:
    """Write, fsync, index and verify this rank's shard; its info and each item's plan."""
    offsets, size = plan_offsets([it.data.nbytes for it in items], knobs.get().alignment)
    w = ShardWriter(
        open_storage(target.job, create=True),
        job=target.job,
        step=target.step,
        rank=target.rank,
        world_size=target.world_size,
        generation=target.generation,
        size=size,
        io_threads=target.io_threads,
    )
    digests = w.write(items, offsets)
    info = w.finish(items, offsets, digests, verify=target.verify)
    plans = ChunkPlan.of_items(items, digests)
    return info, plans


def empty_shard(target: Target) -> ShardInfo:
    info, _ = write_shard(target, [])
    return info


def commit(
    client: CoordinatorClient,
    target: Target,
    shards: dict[int, ShardInfo],
    chunks: dict[int, list[ChunkPlan]],
    tree: Any,
    metadata: dict[str, Any],
    keep_last: int | None,
    timeout_s: float,
) -> None:
    """ckptd's commit protocol on behalf of every rank (ckpt._protocol.commit_for_ranks)."""
    ranks = range(target.world_size)
    commit_for_ranks(
        client,
        [SaveRef(target.job, target.step, target.generation, r, target.world_size) for r in ranks],
        [chunks[r] for r in ranks],
        [ShardReport.of(shards[r], target.verify) for r in ranks],
        state=tree,
        metadata=metadata,
        keep_last=keep_last,
        timeout_s=timeout_s,
    )
