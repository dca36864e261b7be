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
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt._transport import CoordinatorClient
from ckptd import knobs
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.errors import CkptError, SaveAborted
from ckptd.format.manifest import ShardInfo
from ckptd.format.writer import ShardWriter, WriteItem, plan_offsets
from ckptd.storage import open_storage

log = logging.getLogger("ckpt")


def job_path(path: str | os.PathLike[str]) -> str:
    p = os.fspath(path)
    return p if "://" in p else os.path.realpath(os.path.abspath(p))


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
    """ckptd's commit protocol on behalf of every rank: BeginSave, ReportShard, AwaitCommit."""
    where = f"job {target.job!r} step {target.step}"

    def ref(r: int) -> SaveRef:
        return SaveRef(target.job, target.step, target.generation, r, target.world_size)

    def begin(r: int) -> list[int]:
        begun = client.begin_save(
            ref(r),
            chunks[r],
            state=tree,
            metadata=metadata,
            allow_divergent=False,
            keep_last=keep_last or 0,
            timeout_s=timeout_s,
        )
        return begun.write

    def report(r: int) -> str:
        s = shards[r]
        rep = ShardReport.of(s, target.verify)
        return client.report_shard(ref(r), rep).status

    ranks = list(range(target.world_size))
    try:
        # Every rank's BeginSave waits at the coordinator's barrier for the others.
        with ThreadPoolExecutor(len(ranks)) as pool:
            writes = list(pool.map(begin, ranks))
            for r, w in zip(ranks, writes, strict=True):
                if w != list(range(len(chunks[r]))):
                    raise SaveAborted(
                        f"{where} rank {r}: the coordinator assigned chunks {w[:8]} of "
                        f"{len(chunks[r])}; the shards already hold every chunk once, so each must be "
                        "kept (did two ranks write the same chunk?)"
                    )
            statuses = list(pool.map(report, ranks))
        status = client.await_commit(ref(0), timeout_s)
    except BaseException as e:
        abort_quietly(client, ref(0), f"{type(e).__name__}: {e}")
        raise
    if status.status != "COMMITTED":
        raise SaveAborted(
            f"{where}: the save was not committed ({status.status}; reports "
            f"{sorted(set(statuses))}): {status.reason}. Nothing was committed; the previous "
            "step is untouched"
        )


def abort_quietly(client: CoordinatorClient, ref: SaveRef, reason: str) -> None:
    try:
        client.abort_save(ref, reason)
    except CkptError as e:
        log.warning("job %s step %d: could not abort the save: %s", ref.job, ref.step, e)
