"""dcp.save(use_collectives=False) through ckptd: every rank commits its own part.

Without collectives DCP plans each rank alone (no gather of the plans, no deduplication of
replicas) and calls prepare_global_plan, write_data and finish on every rank with that
rank's items only. ckptd's coordinator is the meeting point instead, as for a Checkpointer:
each rank opens the job through ckpt._connect (the zero-config coordinator hosted by rank 0
and found through the process group's store, or a `ckptd serve`), hashes its items, and
BeginSave with its chunks, its part of the state tree and the DCP section; the coordinator's
barrier waits for every rank, deduplicates the replicas every rank planned (each chunk is
written once, by the rank it assigns), and the rank writes only what it is assigned, then
reports its shard. finish awaits the commit. The result is the same ckptd checkpoint as a
collective save's.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
from typing import Any

from ckpt import _connect, _world
from ckpt._protocol import RankSave
from ckpt.integrations import _commit
from ckpt.integrations import _dcp_manifest as dm
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.format.writer import WriteItem, hash_items
from ckptd.storage import open_storage

# The hosting rank's last connection per job: kept open after its finish() (the other ranks
# may still await the commit from its embedded coordinator), closed once the next save of
# the job has opened its own, or at exit.
_held_lock = threading.Lock()
_held: dict[str, _connect.Connection] = {}


def _close_held() -> None:
    with _held_lock:
        conns = list(_held.values())
        _held.clear()
    for c in conns:
        c.close()


atexit.register(_close_held)


@dataclasses.dataclass
class RankPart:
    """One rank's part of a save made without collectives."""

    writer: Any  # the StorageWriter (path, step, options)
    conn: _connect.Connection
    target: _commit.Target
    save: RankSave | None = None

    @classmethod
    def open(cls, w: Any) -> RankPart:
        rank, world = _world.rank_and_world()
        rank = w.rank
        conn = _connect.connect(
            w.path,
            rank=rank,
            world_size=world,
            address=w.coordinator,
            token=w.token,
            attempt=w.attempt,
            lease_s=60.0,
            barrier_timeout_s=w.timeout_s,
        )
        if rank == 0:
            # Before rank 0's BeginSave, so before any rank (all wait at the barrier) writes.
            _commit.begin_step(open_storage(w.path, create=True), w.path, w.step)
        with _held_lock:
            previous = _held.pop(w.path, None)
        if previous is not None:
            previous.close()  # this save's connection holds the coordinator now
        target = _commit.Target(
            w.path, w.step, conn.generation, rank, world, w.verify, w.io_threads
        )
        return cls(w, conn, target)

    def write(
        self,
        planner_data: Any,
        tensors: list[tuple[Any, WriteItem]],
        objects: list[tuple[Any, Any, bool]],
        version: str | None,
    ) -> None:
        """Plan with the coordinator, then write, verify and report the assigned chunks."""
        w, t = self.writer, self.target
        items = [it for _, it in tensors]
        plans = ChunkPlan.of_items(items, hash_items(items))
        leaves: list[tuple[dm.Path, Any]] = []
        tmap: dict[str, tuple[dm.Path, str]] = {}
        omap: dict[str, tuple[dm.Path, str]] = {}
        for item, it in tensors:
            fqn = item.index.fqn
            if fqn not in tmap:
                path = dm.path_of(fqn, planner_data)
                tmap[fqn] = (path, it.key)
                leaves.append((path, {"tensor": it.key}))
        for item, node, bio in objects:
            path = dm.path_of(item.index.fqn, planner_data)
            omap[item.index.fqn] = (path, dm.BYTES_IO if bio else dm.PLAIN)
            leaves.append((path, node))
        tree = dm.build_tree(leaves, f"job {t.job!r} step {t.step} rank {t.rank}")
        meta = {**w.metadata, dm.SECTION: dm.section(version, tmap, omap)}
        assert self.conn.save_client is not None
        ref = SaveRef(t.job, t.step, t.generation, t.rank, t.world_size)
        save = self.save = RankSave(self.conn.save_client, ref, timeout_s=w.timeout_s)
        begun = save.begin(
            plans, state=tree, metadata=meta, allow_divergent=False, keep_last=w.keep_last
        )
        try:
            info, _ = _commit.write_shard(t, [items[i] for i in begun.write])
            save.report(ShardReport.of(info, t.verify))
        except BaseException as e:
            save.abort(f"{type(e).__name__}: {e}")
            raise

    def finish(self) -> None:
        """Await the commit (every rank), then close this rank's connection."""
        try:
            if self.save is None:
                raise RuntimeError(f"{self.target.job}: finish() before write_data()")
            self.save.require_committed(self.save.await_commit(), "")
        finally:
            if self.conn.embedded is not None:
                with _held_lock:
                    _held[self.target.job] = self.conn
            else:
                self.conn.close()
