"""One save as the coordinator holds it: its in-memory state, its manifest, its files.

A `Session` lives from the first BeginSave of (job, step, generation) to its commit or
abort; the core keeps recently ended ones to answer retries. The manifest of a step is
built in one place (`manifest_of`), from a live session or, after a restart, from the
catalog's record of it; the files an aborted save leaves are removed by its generation's
names only (`remove_ranks_files`), never a manifest, never a file a manifest references.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from ckptd.coordinator import planning
from ckptd.coordinator.types import ABORTED, OPEN, ShardReport, StatusResult
from ckptd.errors import CkptError, InvalidRequest, SaveAborted
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout, values, writer
from ckptd.format.manifest import Manifest, ShardInfo, load_index_json, parse_index
from ckptd.storage import Storage
from ckptd.storage.base import OpenDirs

log = logging.getLogger("ckptd.coordinator")

ALIGNMENT = 4096  # the writer's entry alignment (format v1)


@dataclasses.dataclass
class RankPlan:
    parts: int
    received: dict[int, list[planning.ChunkPlan]] = dataclasses.field(default_factory=dict)
    state: Any = None
    rank_state: list[Any] | None = None  # its per-rank entries, when sent apart from state
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    layout: bytes = b""  # the layout digest the rank named (layouts.py), b"" for none

    @property
    def complete(self) -> bool:
        return len(self.received) == self.parts

    def chunks(self) -> list[planning.ChunkPlan]:
        return [c for p in range(self.parts) for c in self.received[p]]

    def by_part(self) -> list[list[planning.ChunkPlan]]:
        return [self.received[p] for p in range(self.parts)]


class Session:
    def __init__(
        self,
        job: str,
        step: int,
        generation: int,
        world_size: int,
        keep_last: int,
        parent: int | None = None,
    ):
        self.job, self.step, self.generation, self.world_size = job, step, generation, world_size
        self.keep_last = keep_last
        self.parent = parent  # the step this state descends from, into the manifest
        self.status = OPEN
        self.reason = ""
        self.plans: dict[int, RankPlan] = {}
        self.assignment: planning.Assignment | None = None
        self.chunks: dict[int, list[planning.ChunkPlan]] = {}
        self.reports: dict[int, ShardReport] = {}
        self.last_seen: dict[int, float] = {}
        self.node_of: dict[int, str] = {}  # rank -> the node aggregator that speaks for it
        self.created = time.monotonic()
        self.barrier_deadline = self.created
        self.allow_divergent = False
        self.planned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done: asyncio.Future[StatusResult] = asyncio.get_running_loop().create_future()
        self.commit_task: asyncio.Task[None] | None = None
        self.manifest_blake3 = ""
        self.bytes = 0
        self.state: Any = None  # merged state tree, once planned
        self.block_sizes: dict[int, int] = {}  # from each reported index
        # The manifest without shards that each reported index is checked against, per
        # block size (one in practice): built once a save, not once a rank.
        self.drafts: dict[int, Manifest] = {}
        self.metadata: dict[str, Any] = {}
        self.all_reported = 0.0  # monotonic time of the last shard's report
        self.abort_kind: type[CkptError] = SaveAborted  # what a rank arriving later gets
        # The last state tree checked, and its per-rank slots: the ranks of a save send
        # one tree (values.split_per_rank), parsed once by the servicer into one object.
        self._checked: tuple[Any, int] | None = None

    def release(self) -> None:
        """Drop what only a live save uses, once it has ended. The ended save stays in the
        coordinator's recent saves (up to 256) to answer retries from its status, reports
        and assignment; the plans, chunks, state tree and draft manifests would stay with
        it, 1-2 objects a tensor, 256 saves long, walked by every full garbage
        collection of the process that runs the coordinator (rank 0's, embedded)."""
        self.plans.clear()
        self.chunks.clear()
        self.drafts.clear()
        self.state, self.metadata, self._checked = None, {}, None

    def check_state(self, state: Any, rank_state: list[Any] | None, where: str) -> None:
        """A rank's state tree and its per-rank entries, checked (the tree once a save)."""
        if state is None:
            return
        if self._checked is None or self._checked[0] is not state:
            values.check_node(state, f"{where} state")
            self._checked = (state, values.count_per_rank(state))
        if rank_state is not None:
            values.check_rank_entries(rank_state, self._checked[1], f"{where} rank_state")

    def claim(self, rank: int, node: str | None) -> None:
        """`node` speaks for `rank` in this save (its BeginSave came in that node's batch);
        a rank another node already spoke for is refused: two processes claim to be it."""
        if node is None:
            return
        prev = self.node_of.setdefault(rank, node)
        if prev != node:
            raise InvalidRequest(
                f"job {self.job!r} step {self.step}: node {node!r} sent rank {rank}, which node "
                f"{prev!r} already speaks for; a rank joins through its own node's aggregator "
                "only (check RANK, LOCAL_RANK and GROUP_RANK / the node's hostname on both)"
            )

    def speaks_for(self, rank: int, node: str | None) -> None:
        """Refuse a node's keep-alive or report for a rank it did not begin the save for."""
        if node is not None and self.node_of.get(rank) != node:
            owner = self.node_of.get(rank)
            raise InvalidRequest(
                f"job {self.job!r} step {self.step}: node {node!r} sent rank {rank}, which "
                + (f"node {owner!r} speaks for" if owner else "joined the save directly")
                + "; a rank reports through the node that began its save"
            )

    def layout_key(self) -> tuple[bytes, ...] | None:
        """Every rank's layout digest in rank order, or None when some rank's plan has
        chunks but named no layout (ckptd.coordinator.layouts)."""
        plans = [self.plans[r] for r in range(self.world_size)]
        if any(not p.layout and any(p.received.values()) for p in plans):
            return None
        return tuple(p.layout for p in plans)

    def fail(self, reason: str, kind: type[CkptError] = SaveAborted) -> None:
        self.status, self.reason, self.abort_kind = ABORTED, reason, kind
        if not self.planned.done():
            self.planned.set_exception(kind(reason))
            self.planned.exception()  # mark retrieved: not every rank may be waiting
        if not self.done.done():
            self.done.set_result(self.answer())

    def overdue(self, now: float, lease_s: float) -> str | None:
        """Why an open save must be aborted now (monotonic `now`), or None: ranks that did
        not join before the barrier deadline, or, once planned, that stopped renewing their
        lease before reporting."""
        if self.status != OPEN:
            return None
        if self.assignment is None:
            if now <= self.barrier_deadline:
                return None
            missing = [
                r
                for r in range(self.world_size)
                if r not in self.plans or not self.plans[r].complete
            ]
            return f"ranks {_ranks(missing)} did not join within the barrier timeout"
        silent = [
            r
            for r in range(self.world_size)
            if r not in self.reports and now - self.last_seen.get(r, self.created) > lease_s
        ]
        if not silent:
            return None
        nodes = sorted({self.node_of[r] for r in silent if r in self.node_of})
        return (
            f"rank(s) {_ranks(silent)} silent for over {lease_s:.0f}s "
            "(lease expired; the process died or hung"
            + (
                f"; of node(s) {', '.join(nodes[:8])}: a node's aggregator renews its ranks' "
                "leases, so a whole node silent is its aggregator (local rank 0) dead or hung"
                if nodes
                else ""
            )
            + ")"
        )

    def answer(self) -> StatusResult:
        kind = self.abort_kind if self.status == ABORTED else SaveAborted
        error = "" if kind is SaveAborted else kind.__name__
        return StatusResult(self.status, self.reason, self.manifest_blake3, error)

    def check_report(self, st: Storage, rank: int, report: ShardReport, files: OpenDirs) -> None:
        """The coordinator's own look at a reported shard (blocking: run in a thread): its
        size, its index's hash, and that the index holds exactly the assigned chunks with
        the planned hashes. `files`: the directories opened for a batch of reports."""
        sdir = layout.step_dir(self.step)
        shard_dir, shard_name = files.where(st, f"{sdir}/{report.shard_path}")
        size = shard_dir.size(shard_name)
        if size != report.size:
            raise CkptError(
                f"{st.url}/{sdir}/{report.shard_path} is {size} bytes, the rank reported {report.size}"
            )
        index_dir, index_name = files.where(st, f"{sdir}/{report.index_path}")
        data = index_dir.read_bytes(index_name, limit=report.index_size)
        if len(data) != report.index_size or hashing.digest(data) != report.index_blake3:
            raise CkptError(
                f"{st.url}/{sdir}/{report.index_path} does not match the reported size/blake3"
            )
        assert self.assignment is not None
        where = f"{st.url}/{sdir}/{report.index_path}"
        doc = load_index_json(data, where)  # parsed once: the block size first, then the index
        block_size = index_block_size(doc)
        self.block_sizes[rank] = block_size
        draft = self.drafts.get(block_size)
        if draft is None:  # worker threads may both build it: equal, either one kept
            draft = self.drafts[block_size] = manifest_of(self, block_size, {}, None)
        shard = report.shard_info(rank)
        if report.index_version and report.index_version != doc.get("version"):
            raise CkptError(
                f"{where}: format version {doc.get('version')!r}, the rank reported "
                f"{report.index_version}"
            )
        index = parse_index(
            None, manifest=draft, shard=shard, max_entries=10**7, what=where, doc=doc
        )
        planned = self.chunks[rank]
        want = {
            (planned[i].key, planned[i].chunk_offsets, planned[i].chunk_sizes): planned[i]
            for i in self.assignment.write[rank]
        }
        got = {(e.key, tuple(e.chunk_offsets), tuple(e.chunk_sizes)): e for e in index.entries}
        if set(want) != set(got):
            missing = sorted(k[0] for k in set(want) - set(got))[:5]
            extra = sorted(k[0] for k in set(got) - set(want))[:5]
            raise CkptError(
                f"shard index holds other chunks than assigned (missing {missing}, unexpected {extra})"
            )
        for k, c in want.items():
            e = got[k]
            if (
                e.dtype != c.dtype
                or e.length != c.length
                or hashing.chunk_digest(e.blake3) != c.blake3
            ):
                raise CkptError(
                    f"key {k[0]!r}: the shard holds other bytes than the rank planned (hash mismatch)"
                )


def check_reports(
    checks: Sequence[tuple[Session, Storage, int, ShardReport]],
) -> list[CkptError | None]:
    """Session.check_report of each (session, storage, rank, report), in one worker call
    (blocking: run in a thread): a node's reports cost one thread hop, not one a rank. The
    error of each report that fails, else None."""
    out: list[CkptError | None] = []
    with OpenDirs() as files:
        for s, st, rank, report in checks:
            try:
                s.check_report(st, rank, report, files)
                out.append(None)
            except CkptError as e:
                out.append(e)
    return out


class SaveIdentity(Protocol):
    """What names a save: a live Session or the catalog's SaveRecord of it."""

    @property
    def job(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def parent(self) -> int | None: ...


class ShardSource(Protocol):
    """A rank's report of its shard: a ShardReport, or a memory save's (memory.py)."""

    def shard_info(self, rank: int) -> ShardInfo: ...


def manifest_of(
    save: SaveIdentity,
    block_size: int,
    reports: Mapping[int, ShardSource],
    state: Any,
    metadata: dict[str, Any] | None = None,
    *,
    alignment: int = ALIGNMENT,
) -> Manifest:
    """The step's manifest: its shards are the ranks' reports, in rank order (a memory
    step's too, with the alignment its ranks wrote at: ckptd.coordinator.memory)."""
    return Manifest(
        job=save.job,
        step=save.step,
        generation=save.generation,
        world_size=save.world_size,
        block_size=block_size,
        alignment=alignment,
        shards=[rep.shard_info(r) for r, rep in sorted(reports.items())],
        state=state,
        metadata=metadata or {},
        parent=save.parent,
    )


def index_block_size(doc: Any) -> int:
    """The hash block size a shard index (parsed JSON) declares."""
    try:
        return int(doc["block_size"])
    except (ValueError, KeyError, TypeError):
        raise CkptError("shard index is not a JSON object with a block_size") from None


def one_block_size(step: int, sizes: Iterable[int]) -> int:
    """The block size every rank used; ranks that disagree fail the save, saying the fix."""
    distinct = set(sizes)
    if len(distinct) != 1:
        raise CkptError(
            f"step {step}: ranks used different hash block sizes {sorted(distinct)}; "
            "set CKPT_BLOCK_SIZE equally on every rank"
        )
    return distinct.pop()


def reported_block_size(st: Storage, step: int, reports: Mapping[int, ShardReport]) -> int:
    """The block size of a step's reported shards, read from their indexes (recovery)."""
    sizes = []
    for rep in reports.values():
        where = f"{layout.step_dir(step)}/{rep.index_path}"
        data = st.read_bytes(where, limit=rep.index_size)
        sizes.append(index_block_size(load_index_json(data, f"{st.url}/{where}")))
    return one_block_size(step, sizes)


def remove_ranks_files(st: Storage, step: int, generation: int, ranks: Iterable[int]) -> None:
    """Remove these ranks' files of an aborted save: its own generation's names only (and
    a lone rank's shard written ahead under its private name), never a manifest, never a
    file the step's manifest (of another generation) references.

    The step's shards are listed once, so the work grows with the files there, not with
    the ranks named: before, an abort of 16,384 ranks checked the manifest 16,384 times
    and removed 32,768 names, each a request on an object store, though most ranks had
    written nothing (and a bogus abort naming 100,000 ranks held a worker thread for
    seconds)."""
    sdir = layout.step_dir(step)
    present = set(st.listdir(f"{sdir}/{layout.SHARDS_DIR}"))
    if not present:
        return
    theirs = []
    for rank in ranks:
        shard = layout.shard_name(rank, generation)
        for name in (shard, writer.ahead_name(shard), layout.index_name(rank, generation)):
            if name.split("/", 1)[1] in present:
                theirs.append(name)
    if theirs and st.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
        try:
            m = ckfmt.read_manifest(st, step)
        except CkptError:
            return  # cannot tell what the committed step needs: touch nothing
        referenced = {x for sh in m.shards for x in (sh.path, sh.index)}
        theirs = [name for name in theirs if name not in referenced]
    for name in theirs:
        try:
            st.remove_tree(f"{sdir}/{name}")
        except (OSError, CkptError) as e:
            log.warning("could not remove %s/%s/%s: %s", st.url, sdir, name, e)


def remove_empty_step(st: Storage, step: int) -> None:
    """Remove a step directory that an abort left empty (no manifest, no shard of any
    generation), so an aborted save leaves nothing behind. Only once no rank of the
    aborted save can still be writing (the caller knows); a save of the same step by a
    newer generation writes there only after its BeginSave, and were one to start in
    between, its shard would fail verification and its save abort: never a commit of a
    partial step."""
    sdir = layout.step_dir(step)
    try:
        names = st.listdir(sdir)
        if set(names) <= {layout.SHARDS_DIR} and not st.listdir(f"{sdir}/{layout.SHARDS_DIR}"):
            st.remove_tree(sdir)
    except (OSError, CkptError) as e:
        log.warning("could not remove the empty step directory %s/%s: %s", st.url, sdir, e)


# How long two saves that cannot both complete may coexist before both are aborted. A
# Checkpointer has one save in flight per rank, but the DCP integration's async saves can
# overlap: two saves' BeginSave threads, all ranks' in one process, may briefly arrive so
# that save A has only rank 0 and save B only rank 1 (the rest a few ms behind).
STEP_MISMATCH_GRACE_S = 1.5


def step_mismatch(s: Session, sessions: Iterable[Session]) -> list[Session]:
    """The saves of `s`'s job and generation that cannot complete alongside `s`, with `s`
    first; empty when there are none.

    Two saves still at the barrier (no assignment yet) whose joined ranks are disjoint can
    never both complete: a rank saves in order, so a rank waiting in one cannot join the
    other before the first is planned, and neither is planned without every rank. (When
    some rank joined both, it left the first somehow; the barrier timeout decides then.)"""

    def waiting(x: Session) -> bool:
        return x.status == OPEN and x.assignment is None and bool(x.plans)

    if not waiting(s):
        return []
    others = [
        x
        for x in sessions
        if x is not s
        and x.job == s.job
        and x.generation == s.generation
        and waiting(x)
        and not set(x.plans) & set(s.plans)
    ]
    return [s, *others] if others else []


def step_mismatch_reason(saves: list[Session]) -> str:
    """The error every rank of these saves gets: each step with the ranks saving it."""
    steps = sorted(saves, key=lambda x: x.step)
    joined = set().union(*(x.plans for x in steps))
    absent = [r for r in range(max(x.world_size for x in steps)) if r not in joined]
    where = "; ".join(f"rank(s) {_ranks(sorted(x.plans))} save step {x.step}" for x in steps)
    return (
        f"job {steps[0].job!r}: the ranks disagree on the step: {where}"
        + (f" (rank(s) {_ranks(absent)} joined neither)" if absent else "")
        + ". None of these saves can gather every rank, so all are aborted. Every rank must "
        "save the same steps in the same order (take the step from a value all ranks share); "
        "a rank that skipped a save with if_busy='skip' while the others made it (its "
        "previous save was still persisting) is this disagreement: use if_busy='wait' with "
        "several ranks, or decide the skip on one rank and share it. Earlier checkpoints are "
        "untouched"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (
        f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else ""
    )
