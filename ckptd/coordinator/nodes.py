"""Node batches: the coordinator sees nodes, not ranks (docs/coordinator.md).

A node's aggregator (ckptd.server.node, on the node's local rank 0) sends its ranks'
BeginSave, KeepAlive and ReportShard messages in one call per phase. Each embedded message
is handled by the per-rank logic the rank would have called (`join_save` and
`planned_answer`, the halves of `begin_save`; `keep_alive`;
`report_shards`, of which a rank's `report_shard` is the batch of one): the commit
protocol, fencing (every message carries its rank's generation) and divergence detection
stay in one place, the core; this module only checks
the batch and runs its ranks together, so that one RPC, one event-loop wake-up, one
worker-thread call (the reports' storage checks) and one catalog transaction serve a node.

A batch is refused whole, naming the node and the rank, when it is malformed: empty,
larger than MAX_NODE_RANKS, ranks of different saves, a rank twice. A rank belongs to one
node per save (Session.claim): a batch carrying a rank that another node already spoke for
aborts the save, since two processes then claim to be that rank.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ckptd.coordinator.layouts import LayoutCache
from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.session import Session
from ckptd.coordinator.types import BeginResult, SaveRef, ShardReport, StatusResult
from ckptd.errors import CkptError, InvalidRequest, LayoutUnknown
from ckptd.faults import crash_point

# Ranks in one node batch: a node holds 8 GPUs today, a few dozen processes at most.
MAX_NODE_RANKS = 256
MAX_NODE_NAME = 256


def check_batch(node: str, refs: Sequence[SaveRef], what: str) -> None:
    """Refuse a malformed batch from `node`, naming the node and the offending rank."""
    if not isinstance(node, str) or not node or len(node) > MAX_NODE_NAME or "\0" in node:
        raise InvalidRequest(
            f"{what} batch: node name {str(node)[:80]!r} must be 1..{MAX_NODE_NAME} characters "
            "without NUL (the aggregator sends its host and node rank)"
        )
    if not refs:
        raise InvalidRequest(f"node {node!r}: empty {what} batch (it must carry >= 1 rank)")
    if len(refs) > MAX_NODE_RANKS:
        raise InvalidRequest(
            f"node {node!r}: {what} batch of {len(refs)} ranks (ranks {refs[0].rank}.."
            f"{refs[-1].rank}), over the limit of {MAX_NODE_RANKS} ranks a node; one "
            "aggregator serves one node's local ranks (LOCAL_WORLD_SIZE)"
        )
    first = refs[0]
    seen: set[int] = set()
    for ref in refs:
        if (ref.job, ref.step, ref.generation, ref.world_size) != (
            first.job,
            first.step,
            first.generation,
            first.world_size,
        ):
            raise InvalidRequest(
                f"node {node!r}: {what} batch mixes saves: rank {ref.rank} names job "
                f"{ref.job!r} step {ref.step} generation {ref.generation} world {ref.world_size}, "
                f"rank {first.rank} job {first.job!r} step {first.step} generation "
                f"{first.generation} world {first.world_size}; one batch is one save"
            )
        if ref.rank in seen:
            raise InvalidRequest(
                f"node {node!r}: {what} batch carries rank {ref.rank} twice (job {ref.job!r} "
                f"step {ref.step})"
            )
        seen.add(ref.rank)


class Nodes:
    """The node-batch RPCs of the Coordinator: each calls the per-rank methods below."""

    # The core's per-rank BeginSave, in its two halves (keyword arguments as the servicer
    # passes them): join the save, then the answer once the plan is made.
    join_save: Callable[..., Awaitable[Session | None]]
    planned_answer: Callable[[Session | None, SaveRef], Awaitable[BeginResult]]
    layouts: LayoutCache

    async def keep_alive(self, ref: SaveRef, node: str | None = None) -> StatusResult:
        raise NotImplementedError

    def job_name(self, job: str) -> str:
        raise NotImplementedError

    def _layout_held(self, ref: SaveRef, chunks: Sequence[ChunkPlan], kw: dict[str, Any]) -> bool:
        """A whole plan, or a cached one whose layout this coordinator holds for the rank."""
        digest = kw.get("layout_digest", b"")
        if chunks or not digest:
            return True
        return self.layouts.holds(self.job_name(ref.job), ref.rank, digest)

    async def report_shards(
        self, reports: Sequence[tuple[SaveRef, ShardReport]], node: str | None = None
    ) -> list[StatusResult | CkptError]:
        raise NotImplementedError

    async def begin_save_node(
        self, node: str, calls: Sequence[tuple[SaveRef, Sequence[ChunkPlan], dict[str, Any]]]
    ) -> list[BeginResult]:
        """The last BeginSave part of each of a node's ranks; answers in the same order.

        The batch's cached plans are resolved together first: a rank whose layout is not
        held (evicted, or this coordinator restarted) makes the whole batch LayoutUnknown
        before any of its ranks joins. Joined siblings would wait at the barrier, holding
        the batch's answer and so the resend it needs, until the barrier timed out."""
        check_batch(node, [ref for ref, _, _ in calls], "BeginSave")
        unknown = [ref.rank for ref, chunks, kw in calls if not self._layout_held(ref, chunks, kw)]
        if unknown:
            first = calls[0][0]
            raise LayoutUnknown(
                f"job {self.job_name(first.job)!r} "
                f"step {first.step} node {node!r}: this coordinator does not hold the cached "
                f"layout of rank(s) {', '.join(map(str, unknown[:16]))} (it restarted or "
                "evicted them); the node's ranks send whole plans"
            )
        # Each rank joins in turn (no task a rank: joining never waits for the others),
        # then the batch waits once at the barrier. Every rank joins even after a sibling
        # failed, as each would on its own; the first failure is the batch's answer.
        joined: list[tuple[SaveRef, Session | None]] = []
        failed: CkptError | None = None
        for ref, chunks, kw in calls:
            try:
                joined.append((ref, await self.join_save(ref, chunks, node=node, **kw)))
            except CkptError as e:
                failed = failed or e
        answers: list[BeginResult] = []
        for ref, s in joined:
            try:
                answers.append(await self.planned_answer(s, ref))
            except CkptError as e:
                failed = failed or e
        if failed is not None:
            raise failed
        crash_point("coordinator.node_batch_unanswered")  # planned; the node not yet told
        return answers

    async def keep_alive_node(self, node: str, refs: Sequence[SaveRef]) -> list[StatusResult]:
        """The node's live ranks renew their leases (one lease a node: one call)."""
        check_batch(node, refs, "KeepAlive")
        answers = []
        for ref in refs:  # in turn: a keep-alive never waits, so no task a rank
            answers.append(await self.keep_alive(ref, node=node))
        return answers

    async def report_shards_node(
        self, node: str, reports: Sequence[tuple[SaveRef, ShardReport]]
    ) -> list[StatusResult]:
        """The node's shard reports; their catalog rows share one transaction."""
        check_batch(node, [ref for ref, _ in reports], "ReportShard")
        answers = await self.report_shards(reports, node)
        for a in answers:
            if isinstance(a, CkptError):
                raise a
        return answers  # type: ignore[return-value]  # no error among them
