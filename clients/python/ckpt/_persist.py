"""One persistent save on one rank, after staging: begin it with the coordinator, then
write, verify and commit what this rank was assigned, under the rank's lease.

begin hashes the staged chunks (or writes ahead of the plan what a rank may, hashing as it
writes), takes the plan from the coordinator's barrier, and writes past the staging budget
or borrows from the parent step as the save asks; commit writes, verifies and reports the
shard and waits for the commit. A failure aborts the save for every rank. When a save runs
and what becomes of its outcome is the Checkpointer's to say (ckpt._checkpointer).
"""

from __future__ import annotations

import dataclasses
import time

from ckpt._pending import PendingSave
from ckpt._protocol import RankSave
from ckpt._results import SaveResult
from ckpt._save_job import SaveJob
from ckptd.coordinator.types import BeginResult, ShardReport
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.format.incremental import borrowable
from ckptd.format.writer import ShardWriteStats
from ckptd.server.client import CoordinatorClient
from ckptd.storage import Storage


@dataclasses.dataclass(frozen=True)
class Begun:
    """A save the coordinator has planned: this rank's side, its hashes, what it writes."""

    save: RankSave
    digests: list[list[str]]
    begun: BeginResult


class Unset:
    """The parent of a Checkpointer's first save before it is looked up."""


JOB_HEAD = Unset()


def begin(
    job: SaveJob,
    parent: int | None | Unset,
    *,
    storage: Storage,
    client: CoordinatorClient,
    timeout_s: float,
    allow_divergent: bool,
    rank: int,
    world_size: int,
) -> Begun:
    """Hash, plan with the coordinator (its barrier waits for every rank); over the
    staging budget, also write the assigned entries past it from the caller's tensors."""
    if isinstance(parent, Unset):
        # Nothing saved or loaded here yet: the state continues the job's live line.
        parent = ckfmt.latest_step(storage)
    save = RankSave(client, job.ref, timeout_s=timeout_s)
    ahead = job.may_write_ahead(world_size)  # hashed as written, before the plan
    try:
        digests = job.write_ahead() if ahead else job.digests()
    except BaseException as e:
        save.abort(f"{type(e).__name__}: {e}")
        raise
    try:
        begun = save.begin(
            job.plan(digests),
            state=job.node,
            metadata=job.metadata,
            allow_divergent=allow_divergent,
            keep_last=job.options.keep_last,
            parent=parent,
        )
    except BaseException:
        job.abort()  # a file written ahead of a refused plan (begin aborted the save)
        raise
    if ahead:
        with save.leased(begun.lease_s):  # a failure here aborts the save
            job.keep_ahead(begun.write)
    if job.options.incremental:
        # Unchanged entries borrow the bytes of the step this state descends from.
        job.borrow_from(borrowable(storage, parent, rank))
    if job.over_budget:
        with save.leased(begun.lease_s):
            job.write_overflow(begun.write, digests)
    return Begun(save, digests, begun)


def commit(
    job: SaveJob, pending: PendingSave, t0: float, b: Begun, *, storage: Storage
) -> SaveResult:
    """Write what this rank was assigned, verify, commit."""
    save, begun = b.save, b.begun
    stats = ShardWriteStats()
    with save.leased(begun.lease_s):
        info = job.write(begun.write, b.digests, stats)
        t_report = time.perf_counter()
        status = save.commit(
            ShardReport.of(
                info,
                job.options.verify,
                staging_s=pending.timings.staging_s,
                persist_s=time.perf_counter() - t0,
                write_s=stats.write_s,
                verify_s=stats.verify_s,
            )
        )
        pending.timings.commit_s = time.perf_counter() - t_report
    save.require_committed(status)
    return SaveResult(
        step=job.step,
        path=f"{storage.url}/{layout.step_dir(job.step)}",
        bytes=job.written_bytes(begun.write),
        borrowed_bytes=job.borrowed_bytes,
        seconds=pending.timings.blocking_s + time.perf_counter() - t0,
        write_s=stats.write_s,
        verify_s=stats.verify_s,
        tensors=len(begun.write),
    )
