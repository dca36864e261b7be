"""Memory checkpoints, committed by the coordinator (docs/memory-tier.md).

A memory save's shards never reach storage: each rank writes its shard into its node
agent's shared memory, the agent checks every block and copies it to its ring peers, and
each agent tells the rank the index digest it computed. The coordinator decides the commit
from what the ranks report (the MemorySave RPC, one call per phase):

    join   the rank begins placing its shard (its lease starts; the save is created)
    alive  renews the rank's lease while it places
    held   the shard is placed: ShardInfo, the nodes holding it with their digests, and
           the rank's state tree (rank 0: metadata and parent)
    await  waits for the decision: COMMITTED with the manifest, or ABORTED
    abort  the rank gave up (its own failure); every rank learns it

The rule (`decide`): every rank reported, and each shard is held on at least `copies`
distinct nodes (2, or every node of a smaller job, or fewer when the job asked for fewer
replicas) whose agents computed the digest the rank reported. Then the coordinator builds
the manifest (the same format as storage's: the ranks' ShardInfos, their merged state),
records the "memory" tier HELD in the catalog (the nodes and the manifest digest), and only
then answers; each rank writes the manifest into its node's agent. A save that fails the
rule, or times out, is recorded FAILED with the reason.

Fencing: a request of an older generation is refused (StaleGeneration, as for any save),
and a newer generation aborts the older one's memory saves (`_fence_memory`, called where
the generation advances). Leases: a joined rank silent for a lease (it died mid-save), or
a rank that never joins within the save's timeout, aborts it (`_memory_overdue`, from the
watchdog). Recovery: a memory save lives in the coordinator's memory only (it is cheap and
the next one follows in a few steps): after a restart a rank's next call finds it unknown
and is told ABORTED; a decided one is in the catalog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from ckptd.coordinator import planning
from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.session import manifest_of
from ckptd.coordinator.types import (
    ABORTED,
    COMMITTED,
    OPEN,
    TIER_FAILED,
    TIER_HELD,
    SaveRef,
    StatusResult,
)
from ckptd.errors import CheckpointExists, CkptError, InvalidRequest
from ckptd.format import hashing, layout
from ckptd.format.manifest import Manifest, ShardInfo
from ckptd.storage.paths import check_relative

log = logging.getLogger("ckptd.coordinator")

TIER = "memory"
PHASES = ("join", "alive", "held", "await", "abort")
MAX_FINISHED = 64
MAX_AWAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """One rank's account of its placed shard (phase "held")."""

    shard: ShardInfo
    held: dict[int, str]  # node -> the index digest that node's agent computed
    node: int  # the rank's own node
    nodes: int  # the job's node count
    copies: int  # the holders the job asks for (min(2, nodes) unless fewer replicas)
    block_size: int
    alignment: int
    state: Any
    metadata: dict[str, Any]
    parent: int | None
    url: str  # the memory tier's place, for the catalog

    def shard_info(self, rank: int) -> ShardInfo:
        """The manifest's entry (manifest_of's ShardSource; decide checked the rank)."""
        return self.shard

    @classmethod
    def parse(cls, doc: Any, where: str) -> MemoryReport:
        """A report from the wire's JSON, every field checked by name and type."""
        try:
            if not isinstance(doc, dict):
                raise TypeError("not a JSON object")
            s = doc["shard"]
            shard = ShardInfo(
                int(s["rank"]),
                check_relative(str(s["path"]), what="shard path"),
                int(s["size"]),
                check_relative(str(s["index"]), what="index path"),
                int(s["index_size"]),
                str(s["index_blake3"]),
            )
            held = {int(h["node"]): str(h["index_blake3"]) for h in doc["held"]}
            nodes, node, copies = int(doc["nodes"]), int(doc["node"]), int(doc["copies"])
            metadata = doc.get("metadata") or {}
            parent = doc.get("parent")
            report = cls(
                shard=shard,
                held=held,
                node=node,
                nodes=nodes,
                copies=copies,
                block_size=int(doc["block_size"]),
                alignment=int(doc["alignment"]),
                state=doc.get("state"),
                metadata=metadata,
                parent=None if parent is None else int(parent),
                url=str(doc.get("url", ""))[:1000],
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise InvalidRequest(f"{where}: a bad memory report ({e!r})") from None
        if not isinstance(metadata, dict):
            raise InvalidRequest(f"{where}: metadata must be a JSON object")
        if not 1 <= nodes <= layout.MAX_RANK + 1 or not 0 <= node < nodes:
            raise InvalidRequest(f"{where}: node {node} of {nodes} is out of range")
        if not 1 <= copies <= nodes:
            raise InvalidRequest(f"{where}: {copies} copies asked of {nodes} node(s)")
        if any(not 0 <= n < nodes for n in held):
            raise InvalidRequest(f"{where}: holders {sorted(held)} outside nodes [0, {nodes})")
        if shard.size < 0 or shard.index_size <= 0 or not shard.path.startswith("shards/"):
            raise InvalidRequest(f"{where}: not a shard ({shard.path}, {shard.size} bytes)")
        return report


@dataclasses.dataclass
class MemorySave:
    """One memory save of (job, step, generation), as the coordinator holds it."""

    job: str
    step: int
    generation: int
    world_size: int
    deadline: float  # every rank joins before this
    last_seen: dict[int, float] = dataclasses.field(default_factory=dict)
    reports: dict[int, MemoryReport] = dataclasses.field(default_factory=dict)
    status: str = OPEN
    reason: str = ""
    manifest: bytes = b""
    digest: str = ""
    done: asyncio.Future[None] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def parent(self) -> int | None:
        """The step it descends from, as rank 0 reported it (manifest_of's SaveIdentity)."""
        return self.reports[0].parent

    def answer(self) -> tuple[StatusResult, bytes]:
        return StatusResult(self.status, self.reason, self.digest), self.manifest

    def overdue(self, now: float, lease_s: float) -> str | None:
        if self.status != OPEN:
            return None
        if len(self.last_seen) < self.world_size and now > self.deadline:
            missing = sorted(set(range(self.world_size)) - set(self.last_seen))
            return f"ranks {missing[:16]} never began this memory save"
        for r, t in self.last_seen.items():
            if r not in self.reports and now - t > lease_s:
                return (
                    f"rank {r} went silent for {now - t:.0f} s (lease {lease_s:.0f} s) while "
                    "placing its shard (its process died or hung)"
                )
        return None


def decide(s: MemorySave) -> tuple[Manifest | None, str, list[int]]:
    """The commit rule: (manifest, "", the nodes holding shards) when every shard is held
    on enough distinct nodes with agreeing digests, else (None, why, [])."""
    first = s.reports[min(s.reports)]
    short = []
    for r, rep in sorted(s.reports.items()):
        if rep.nodes != first.nodes or rep.copies != first.copies:
            return (
                None,
                f"rank {r} says {rep.nodes} nodes / {rep.copies} copies, rank "
                f"{min(s.reports)} {first.nodes} / {first.copies}",
                [],
            )
        if rep.shard.rank != r:
            return None, f"rank {r} reported rank {rep.shard.rank}'s shard", []
        agree = {n for n, d in rep.held.items() if d == rep.shard.index_blake3}
        if rep.node not in rep.held:
            short.append(f"rank {r}: its own node {rep.node} does not hold it")
        elif len(agree) < rep.copies:
            bad = sorted(set(rep.held) - agree)
            short.append(
                f"rank {r}: held on nodes {sorted(agree)}"
                + (f" (digests of nodes {bad} disagree)" if bad else "")
                + f", {rep.copies} needed"
            )
    if short:
        return None, "shards not held on enough nodes: " + "; ".join(short), []
    sizes = {(rep.block_size, rep.alignment) for rep in s.reports.values()}
    if len(sizes) != 1:
        return None, f"the ranks' block sizes / alignments differ: {sorted(sizes)}", []
    block, align = sizes.pop()
    try:
        state = planning.merge_states({r: rep.state for r, rep in s.reports.items()})
    except (CkptError, ValueError, TypeError, RecursionError) as e:
        return None, f"the ranks' state trees cannot be combined: {e}", []
    # The one manifest builder (a persistent step's too); rank 0's metadata and parent.
    m = manifest_of(s, block, s.reports, state, s.reports[0].metadata, alignment=align)
    held = sorted({n for rep in s.reports.values() for n in rep.held})
    return m, "", held


class MemoryCommits:
    """The MemorySave RPC, mixed into the Coordinator, which provides what is declared."""

    catalog: Catalog
    lease_s: float
    barrier_timeout_s: float
    sessions: Mapping[tuple[str, int], object]  # the open persistent saves
    # Set by the Coordinator: the open memory saves, and those that ended recently (so a
    # retry, or a rank that is late to ask, gets the same answer).
    memory_saves: dict[tuple[str, int], MemorySave]
    memory_ended: dict[tuple[str, int, int], MemorySave]

    def _check_ref(self, ref: SaveRef) -> str:
        raise NotImplementedError

    async def memory_save(
        self,
        ref: SaveRef,
        phase: str,
        report: Any = None,
        *,
        timeout_s: float = 0.0,
        reason: str = "",
    ) -> tuple[StatusResult, bytes]:
        """One rank's call of a memory save (the module docstring): its status, and the
        manifest once COMMITTED."""
        job = self._check_ref(ref)  # fencing: an older generation is refused here
        where = f"job {job!r} step {ref.step} rank {ref.rank} (memory)"
        if phase not in PHASES:
            raise InvalidRequest(f"{where}: unknown phase {phase!r}")
        saves = self.memory_saves
        s = saves.get((job, ref.step))
        if s is not None and s.generation < ref.generation:
            await self._end_memory(s, ABORTED, f"superseded by generation {ref.generation}")
            s = None
        if s is None or s.generation != ref.generation:
            s = self.memory_ended.get((job, ref.step, ref.generation))
        if s is None:
            if phase != "join":
                # Never begun here: this coordinator restarted since (a memory save is not
                # recovered; the next one follows), or the rank skipped the join.
                why = "the coordinator does not know this memory save (it restarted since?)"
                return StatusResult(ABORTED, why, ""), b""
            if (job, ref.step) in self.sessions:
                raise CheckpointExists(f"{where}: a persistent save of this step is open")
            timeout = min(max(timeout_s, self.lease_s), self.barrier_timeout_s)
            s = MemorySave(
                job, ref.step, ref.generation, ref.world_size, time.monotonic() + timeout
            )
            saves[(job, ref.step)] = s
        if s.world_size != ref.world_size:
            raise InvalidRequest(
                f"{where}: world size {ref.world_size}, the save has {s.world_size}"
            )
        if s.status != OPEN:
            return s.answer()
        s.last_seen[ref.rank] = time.monotonic()
        if phase == "abort":
            await self._end_memory(s, ABORTED, f"rank {ref.rank} gave up: {reason[:1000]}")
        elif phase == "held":
            rep = MemoryReport.parse(report, where)
            old = s.reports.get(ref.rank)
            if old is not None and old.shard != rep.shard:
                raise InvalidRequest(f"{where}: re-reported with a different shard")
            s.reports[ref.rank] = rep
            if len(s.reports) == s.world_size:
                await self._decide_memory(s)
        elif phase == "await":
            try:  # in slices: the client asks again (a dead coordinator is noticed soon)
                await asyncio.wait_for(
                    asyncio.shield(s.done), min(max(0.0, timeout_s), MAX_AWAIT_S)
                )
            except TimeoutError:
                pass
        return s.answer()

    async def _decide_memory(self, s: MemorySave) -> None:
        m, why, held = decide(s)
        if m is None:
            await self._end_memory(s, ABORTED, f"memory checkpoint not committed: {why}")
            return
        data = m.to_bytes()
        s.manifest, s.digest = data, hashing.digest(data)
        await self._end_memory(s, COMMITTED, f"nodes {held}; manifest {s.digest}")

    async def _end_memory(self, s: MemorySave, status: str, reason: str) -> None:
        """Record the outcome in the catalog, then tell the ranks (durable before heard)."""
        if s.status != OPEN:
            return
        s.status, s.reason = status, reason
        if self.memory_saves.get((s.job, s.step)) is s:
            del self.memory_saves[(s.job, s.step)]
        ended = self.memory_ended
        ended[(s.job, s.step, s.generation)] = s
        while len(ended) > MAX_FINISHED:
            del ended[next(iter(ended))]
        url = next((r.url for r in s.reports.values() if r.url), "agent://")
        s.reports = {}  # the states can be large; the answer is the manifest
        tier_status = TIER_HELD if status == COMMITTED else TIER_FAILED
        try:
            await self.catalog.record_tier(s.job, s.step, TIER, url, tier_status, reason)
        except CkptError as e:
            if status == COMMITTED:  # not durable: it is not committed
                s.status, s.reason, s.manifest, s.digest = ABORTED, f"catalog: {e}", b"", ""
            log.warning("job %s step %d: memory tier not recorded: %s", s.job, s.step, e)
        finally:
            if not s.done.done():
                s.done.set_result(None)
        if s.status == COMMITTED:
            log.info("committed job %s step %d in memory (%s)", s.job, s.step, reason)
        else:
            log.warning("memory save job %s step %d: %s", s.job, s.step, s.reason)

    async def _fence_memory(self, job: str, generation: int) -> None:
        """A newer generation of `job` began: its older memory saves are aborted."""
        for s in list(self.memory_saves.values()):
            if s.job == job and s.generation < generation:
                await self._end_memory(s, ABORTED, f"superseded by generation {generation}")

    async def _memory_overdue(self, now: float) -> None:
        """The watchdog's pass over the memory saves (a rank died mid-save)."""
        for s in list(self.memory_saves.values()):
            why = s.overdue(now, self.lease_s)
            if why is not None:
                await self._end_memory(s, ABORTED, why)
