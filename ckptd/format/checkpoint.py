"""A job directory as a set of steps: list, open, commit, verify, remove.

Storage alone describes every checkpoint (promise 6): a step is committed exactly when
its MANIFEST.json exists and parses; everything else in a step directory is either part
of a committed step or debris of a save that never committed. Opening a step checks the
manifest, every index against the digest the manifest holds, and every shard's size,
before a single tensor byte is read. An entry's bytes may lie in earlier steps' files (an
incremental save borrows whole entries or blocks of them): `OpenCheckpoint.pieces` says
where each part is (manifest.entry_pieces), and `check_borrowed` that each lender is
committed and holds the range, before a byte is read.

A committed step that later fails verification on load is *quarantined*: a
`QUARANTINED.json` marker (reason, time, host) is written into its directory, atomically.
Its manifest stays, so it can still be inspected, verified or loaded by explicit step, but
listing reports it as QUARANTINED and the newest-step resolution (resume, load without a
step) skips it. Removing the marker puts the step back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Protocol

from ckptd import knobs
from ckptd.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    CorruptCheckpoint,
    InvalidManifest,
    ShardMissing,
    ShardSizeMismatch,
    UnsafePath,
)
from ckptd.faults import crash_point
from ckptd.format import hashing, layout, values
from ckptd.format.manifest import (
    IndexEntry,
    Manifest,
    ShardIndex,
    ShardInfo,
    entry_pieces,
    load_index_json,
    parse_index,
    parse_manifest,
)
from ckptd.format.reader import verify_entries
from ckptd.storage.base import OpenDirs, Storage

COMMITTED = "COMMITTED"
INCOMPLETE = "INCOMPLETE"  # a step directory without a manifest: an unfinished save
# An INCOMPLETE step's reason. Retention un-publishes a step (its manifest first, so that a
# crash leaves debris, never a half checkpoint) before removing its files: for that moment
# a step being retired looks like a save that never committed.
NO_MANIFEST = (
    "no MANIFEST.json: a save that never committed (aborted, or a rank died mid-write), "
    "or a step that retention is removing"
)
INVALID = "INVALID"  # a manifest that does not parse, or a step that is a symlink
QUARANTINED = "QUARANTINED"  # committed, but failed verification at load time: skipped
QUARANTINE_NAME = "QUARANTINED.json"
_MAX_MARKER_BYTES = 1 << 16


class Lineage(Protocol):
    """What the live line needs of a step: its number, its parent, when it was saved."""

    @property
    def step(self) -> int: ...
    @property
    def parent(self) -> int | None: ...
    @property
    def saved_unix(self) -> float: ...
    @property
    def borrows(self) -> tuple[int, ...] | None: ...


@dataclasses.dataclass(frozen=True)
class LineStep:
    step: int
    parent: int | None
    saved_unix: float
    borrows: tuple[int, ...] | None = ()  # the steps it borrows bytes from (ancestors)

    @classmethod
    def of(cls, m: Manifest) -> LineStep:
        """A committed step's place on the job's line, from its manifest."""
        return cls(m.step, m.parent, m.created_unix, tuple(m.borrows))


@dataclasses.dataclass
class StepInfo:
    step: int
    status: str
    manifest: Manifest | None = None  # list_steps(manifests=False) leaves it out
    error: str | None = None
    line: LineStep | None = None  # whenever the manifest parsed: what the live line needs


@dataclasses.dataclass
class Chunk:
    shard: ShardInfo
    entry: IndexEntry


@dataclasses.dataclass
class OpenCheckpoint:
    """A committed step whose manifest, indexes and shard sizes have been checked."""

    storage: Storage
    manifest: Manifest
    indexes: list[ShardIndex]
    chunks: dict[str, list[Chunk]]
    # Every file the step's entries are read from, relative to the job directory: its own
    # shards in manifest order, then the files of earlier steps it borrows from, sorted.
    # A file's position here is how the shared read plan names stored bytes.
    files: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        block = self.manifest.block_size
        # Each entry's pieces (entry_pieces: the one rule for where its bytes are), by entry.
        self._pieces: dict[int, list[IndexEntry]] = {
            id(e): entry_pieces(e, block) for idx in self.indexes for e in idx.entries
        }
        if not self.files:
            own = [self.shard_path(s) for s in self.manifest.shards]
            lent = {
                layout.job_path(self.step, p.file)
                for ps in self._pieces.values()
                for p in ps
                if layout.split_borrowed(p.file) is not None
            }
            self.files = own + sorted(lent - set(own))
        self._file_no = {f: i for i, f in enumerate(self.files)}

    @property
    def step(self) -> int:
        return self.manifest.step

    def pieces(self, entry: IndexEntry) -> list[tuple[int, IndexEntry]]:
        """(file number, piece) of where each part of an entry of this step is stored, in
        the entry's order (manifest.entry_pieces): a piece is an entry of that file, and
        `piece.start` is where it begins in `entry`. One piece for all but an entry of
        which only some blocks are borrowed."""
        got = self._pieces.get(id(entry))
        if got is None:  # an entry of this step passed as a copy
            got = entry_pieces(entry, self.manifest.block_size)
        return [(self._file_no[layout.job_path(self.step, p.file)], p) for p in got]

    def file_no(self, path: str) -> int:
        """The position of a file of `files` (relative to the job directory)."""
        return self._file_no[path]

    def stored(self) -> Iterator[tuple[int, IndexEntry]]:
        """(file number, piece) of every stored range of every entry: a stored range is
        (file, piece.offset), and no two pieces of a step share one (check_borrowed)."""
        for idx in self.indexes:
            for e in idx.entries:
                yield from self.pieces(e)

    @property
    def owned_bytes(self) -> int:
        """Bytes of the entries this step holds in its own shards."""
        return sum(p.length for _, p in self.stored() if layout.split_borrowed(p.file) is None)

    @property
    def borrowed_bytes(self) -> int:
        """Bytes of the entries it reads from earlier steps' files (whole entries or blocks)."""
        return sum(p.length for _, p in self.stored() if layout.split_borrowed(p.file) is not None)

    @property
    def step_dir(self) -> str:
        return layout.step_dir(self.manifest.step)

    def shard_path(self, shard: ShardInfo) -> str:
        return f"{self.step_dir}/{shard.path}"

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.manifest.shards)


def _where(storage: Storage, step: int, name: str = "") -> str:
    base = f"{storage.url}/{layout.step_dir(step)}"
    return f"{base}/{name}" if name else base


def list_steps(storage: Storage, *, manifests: bool = True) -> list[StepInfo]:
    """Every step directory of the job, by step, with its status (and, unless
    manifests=False, its parsed manifest: the live line needs only each step's `line`,
    which read_lineage remembers)."""
    out = []
    for name in storage.listdir(""):
        step = layout.parse_step_dir(name)
        if step is None:
            continue
        mpath = f"{name}/{layout.MANIFEST_NAME}"
        try:
            present = storage.exists(mpath)
        except UnsafePath as e:  # a step that is a symlink: one bad step, not a bad job
            out.append(StepInfo(step, INVALID, error=str(e)))
            continue
        if not present:
            out.append(StepInfo(step, INCOMPLETE, error=NO_MANIFEST))
            continue
        m: Manifest | None = None
        try:
            if manifests:
                m = read_manifest(storage, step)
                line = LineStep.of(m)
            else:
                line = read_lineage(storage, step)
        except CkptError as e:
            out.append(StepInfo(step, INVALID, error=str(e)))
            continue
        reason = quarantine_reason(storage, step)
        status = COMMITTED if reason is None else QUARANTINED
        out.append(StepInfo(step, status, manifest=m, error=reason, line=line))
    return sorted(out, key=lambda s: s.step)


def quarantine_reason(storage: Storage, step: int) -> str | None:
    """Why the step was quarantined, or None when it is not."""
    path = f"{layout.step_dir(step)}/{QUARANTINE_NAME}"
    if not storage.exists(path):
        return None
    try:
        doc = json.loads(storage.read_bytes(path, limit=_MAX_MARKER_BYTES))
        reason = doc.get("reason") if isinstance(doc, dict) else None
        return str(reason) if reason else "quarantined (no reason recorded)"
    except (CkptError, ValueError, UnicodeDecodeError):
        return "quarantined (the marker is unreadable)"


def quarantine(storage: Storage, step: int, reason: str) -> str:
    """Mark a committed step as bad so that newest-step resolution skips it; the reason in
    force, which is the first one: a marker already there (a peer rank's, the
    coordinator's) is kept as it is.

    The marker is written atomically; the manifest and shards are left as they are (for
    inspection, `ckptctl verify`, or loading by explicit step).
    """
    first = quarantine_reason(storage, step)
    if first is not None:
        return first
    doc = {
        "step": step,
        "reason": reason[:8000],
        "time_unix": time.time(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    storage.write_atomic(
        f"{layout.step_dir(step)}/{QUARANTINE_NAME}", json.dumps(doc, indent=1).encode()
    )
    return reason


def clear_stale_marker(storage: Storage, step: int) -> None:
    """Before a manifest of `step` is published: a quarantine marker in a step directory
    without a manifest belongs to a checkpoint that is gone (a give-way that a crash cut
    short after removing the manifest: retention.make_way), never to the one about to be
    committed, which it would mark bad."""
    path = f"{layout.step_dir(step)}/{QUARANTINE_NAME}"
    if storage.exists(path) and not storage.exists(
        f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}"
    ):
        storage.remove_tree(path)


def unquarantine(storage: Storage, step: int) -> bool:
    """Remove a step's quarantine marker; True when there was one."""
    path = f"{layout.step_dir(step)}/{QUARANTINE_NAME}"
    if not storage.exists(path):
        return False
    storage.remove_tree(path)
    return True


def _manifest_bytes(storage: Storage, step: int) -> bytes:
    path = f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}"
    limit = knobs.get().max_manifest_bytes
    try:
        return storage.read_bytes(path, limit=limit)
    except ShardMissing:
        raise CheckpointNotFound(
            f"{_where(storage, step)} has no committed checkpoint (no {layout.MANIFEST_NAME})"
        ) from None
    except InvalidManifest as e:
        raise InvalidManifest(
            f"{e}: a manifest over the {limit}-byte limit is not parsed (raise "
            "CKPT_MAX_MANIFEST_BYTES if it is genuine)"
        ) from None


def _check_in_place(storage: Storage, step: int, says: int) -> None:
    if says != step:
        raise InvalidManifest(
            f"{_where(storage, step, layout.MANIFEST_NAME)} says step {says}; "
            "it was copied from another step directory"
        )


def read_manifest(storage: Storage, step: int, *, blake3: str | None = None) -> Manifest:
    """The step's manifest, parsed and checked.

    blake3: the manifest's digest as the coordinator's catalog recorded it at commit. The
    manifest holds each index's digest and each index each block's, so this one digest
    pins every byte of the step: a consistent rewrite of shards, indexes and manifest
    together is still refused.
    """
    data = _manifest_bytes(storage, step)
    if blake3 is not None and hashing.digest(data) != blake3:
        raise CorruptCheckpoint(
            f"{_where(storage, step, layout.MANIFEST_NAME)}: blake3 {hashing.digest(data)[:16]} "
            f"is not the {blake3[:16] or '(none)'} the coordinator's catalog recorded when step "
            f"{step} was committed: the step was rewritten after its commit. Do not use it: "
            "load an earlier step or restore it from a replica"
        )
    m = parse_manifest(data, what=_where(storage, step, layout.MANIFEST_NAME))
    _check_in_place(storage, step, m.step)
    return m


# Each parsed manifest's place on the line, by the blake3 of its bytes. A save that looks
# up its parent, a load without a step and retention each find the live line's head from
# every kept step's manifest, every time; the bytes are still read each time (a manifest
# replaced or damaged since is seen), but parsed only when new (bench/README.md, issue 16
# eleventh pass). LineStep is immutable, so a hit can be handed out as it is.
_LINES: hashing.DigestMemo[LineStep] = hashing.DigestMemo(4096)


def read_lineage(storage: Storage, step: int) -> LineStep:
    """The step's place on the job's line, from its manifest: the same parse and checks as
    read_manifest the first time these bytes are seen."""
    data = _manifest_bytes(storage, step)
    digest = hashing.digest(data)
    line = _LINES.get(digest)
    if line is None:
        line = LineStep.of(parse_manifest(data, what=_where(storage, step, layout.MANIFEST_NAME)))
        _LINES.put(digest, line)
    _check_in_place(storage, step, line.step)
    return line


def live_line(steps: Iterable[Lineage], gaps: Collection[int] = ()) -> list[int]:
    """The job's live line, head first: the one rule for "newest" (docs/concepts.md,
    Rollbacks and the live line), used by the load policy (ckpt._load) and by retention.

    The head is the step saved last (by `saved_unix`, commit order; ties by step), and the
    line runs back through each step's parent. A step without a recorded parent (a job's
    first save, or a manifest from before lineage was recorded) continues the line in step
    order, the highest lower step next; when no step records a parent at all the head is
    the highest step. So a job that never rolled back has the line it always had, and
    after a rollback the steps of the abandoned branch are on no line. A parent in `gaps`
    (a step directory whose manifest is missing or unreadable: damage, not a removal)
    continues the line in step order below it; a parent that is gone altogether (retired)
    ends the line, unless the step borrows bytes from steps still there (an incremental
    save borrows only from its ancestors): then the line goes on at the newest of those.
    """
    by_step = {s.step: s for s in steps}
    if not by_step:
        return []
    if any(s.parent is not None for s in by_step.values()):
        head = max(by_step.values(), key=lambda s: (s.saved_unix, s.step)).step
    else:
        head = max(by_step)
    line = [head]
    while True:
        cur = by_step[line[-1]]
        nxt: int | None
        if cur.parent in by_step:
            nxt = cur.parent
        elif cur.parent is None or cur.parent in gaps:
            below = cur.step if cur.parent is None else cur.parent
            nxt = max((k for k in by_step if k < below and k not in line), default=None)
        else:
            lenders = [by_step[k] for k in cur.borrows or () if k in by_step]
            newest = max(lenders, key=lambda s: (s.saved_unix, s.step), default=None)
            nxt = None if newest is None else newest.step
        if nxt is None or nxt in line:  # a cycle (hand-edited manifests) ends the line
            return line
        line.append(nxt)


def line_of(infos: Iterable[StepInfo]) -> list[int]:
    """The live line of listed steps (`list_steps`): those with a manifest, head first.

    A quarantined step stays on the line (it is an ancestor); loads skip it."""
    infos = list(infos)
    return live_line(
        (s.line for s in infos if s.line is not None and s.status in (COMMITTED, QUARANTINED)),
        gaps={s.step for s in infos if s.status in (INCOMPLETE, INVALID)},
    )


def head_of(infos: Iterable[StepInfo]) -> int | None:
    """What a load without a step loads first: the newest committed (not quarantined)
    step of the live line; None when the line has none."""
    infos = list(infos)
    committed = {s.step for s in infos if s.status == COMMITTED}
    return next((k for k in line_of(infos) if k in committed), None)


def latest_step(storage: Storage) -> int | None:
    """The head of the job's live line (what resume loads), or None (`head_of`)."""
    return head_of(list_steps(storage, manifests=False))


def resolve_step(storage: Storage, step: int | None) -> int:
    if step is not None:
        return layout.check_step(step)
    steps = list_steps(storage, manifests=False)
    head = head_of(steps)
    if head is not None:
        return head
    if any(s.status == COMMITTED for s in steps):
        raise CheckpointNotFound(
            f"{storage.url}: the live line holds no committed step (its steps are "
            "quarantined); load an abandoned step by its number (ckptctl list shows them)"
        )
    if steps:
        detail = "; ".join(f"step {s.step}: {s.status.lower()} ({s.error})" for s in steps[-5:])
        raise CheckpointNotFound(
            f"{storage.url} has step directories but no committed checkpoint: {detail}. "
            "Nothing was loaded; check the job's logs for the failed saves"
        )
    raise CheckpointNotFound(f"{storage.url} holds no checkpoints (no step-* directories)")


def committed_steps(storage: Storage) -> list[int]:
    """Committed, not quarantined steps, highest step first (on the live line or not)."""
    return [s.step for s in reversed(list_steps(storage, manifests=False)) if s.status == COMMITTED]


def open_checkpoint(
    storage: Storage, step: int | None = None, *, manifest_blake3: str | None = None
) -> OpenCheckpoint:
    """Open the given (or newest committed) step, checking indexes and shard sizes
    (and the manifest against the catalog's digest, when given: read_manifest)."""
    step = resolve_step(storage, step)
    m = read_manifest(storage, step, blake3=manifest_blake3)
    k = knobs.get()
    indexes: list[ShardIndex] = []
    chunks: dict[str, list[Chunk]] = {}
    for shard in m.shards:
        index = read_index(storage, m, shard, max_entries=k.max_entries_per_shard)
        check_shard_size(storage, m, shard)
        indexes.append(index)
        for e in index.entries:
            chunks.setdefault(e.key, []).append(Chunk(shard, e))
    for tag, key in values.tensor_refs(m.state):
        if key not in chunks:
            raise InvalidManifest(
                f"{_where(storage, step, layout.MANIFEST_NAME)}: state refers to {tag} {key!r} "
                "which no shard index holds"
            )
    check_borrowed(storage, m, indexes)
    return OpenCheckpoint(storage, m, indexes, chunks)


def check_borrowed(storage: Storage, m: Manifest, indexes: Iterable[ShardIndex]) -> None:
    """Every borrowed piece (a whole entry, or blocks of one: manifest.entry_pieces) names
    a committed step the manifest lists, a shard of it that is there with its recorded size,
    and a range inside it, no two pieces overlapping.

    The bytes themselves are checked when they are read, against the borrowing entry's own
    block hashes (which the lending step's index also holds: the save matched them)."""
    lenders: dict[int, dict[str, ShardInfo]] = {}
    taken: dict[str, list[tuple[int, int, str]]] = {}
    for idx in indexes:
        for e in idx.entries:
            for p in entry_pieces(e, m.block_size):
                lent = layout.split_borrowed(p.file)
                if lent is None:
                    continue
                k, name = lent
                where = (
                    f"job {storage.url} step {m.step} rank {idx.rank} key {e.key!r} "
                    f"(file {p.file}, blocks {p.first_block}..{p.first_block + len(p.blake3)})"
                )
                if k not in lenders:
                    try:
                        lm = read_manifest(storage, k)
                    except CkptError as err:
                        raise CheckpointNotFound(
                            f"{where}: borrows its bytes from step {k}, which is not a "
                            f"committed step ({err}); step {m.step} is not whole: load an "
                            "earlier step"
                        ) from None
                    lenders[k] = {s.path: s for s in lm.shards}
                    for s in lm.shards:
                        check_shard_size(storage, lm, s)
                shard = lenders[k].get(name)
                if shard is None:
                    raise InvalidManifest(
                        f"{where}: step {k} has no shard {name!r}; the index was altered"
                    )
                if p.offset + p.length > shard.size:
                    raise InvalidManifest(
                        f"{where}: bytes {p.offset}..{p.offset + p.length} are not a range of "
                        f"its {shard.size}-byte shard; the index was altered"
                    )
                taken.setdefault(p.file, []).append((p.offset, p.offset + p.length, where))
    for file, ranges in taken.items():
        ranges.sort()
        for (_, end, _), (lo, hi, where) in zip(ranges, ranges[1:], strict=False):
            if lo < end:
                raise InvalidManifest(
                    f"{where}: bytes {lo}..{hi} of {file} are borrowed by another entry of "
                    "this step too; the index was altered"
                )


def read_index(storage: Storage, m: Manifest, shard: ShardInfo, *, max_entries: int) -> ShardIndex:
    path = f"{layout.step_dir(m.step)}/{shard.index}"
    where = _where(storage, m.step, shard.index)
    limit = knobs.get().max_index_bytes
    if shard.index_size > limit:
        raise InvalidManifest(
            f"{where} (index of rank {shard.rank}) is {shard.index_size} bytes by the "
            f"manifest, over the {limit}-byte limit: it is not parsed (raise "
            "CKPT_MAX_INDEX_BYTES if it is genuine)"
        )
    try:
        data = storage.read_bytes(path, limit=shard.index_size)
    except ShardMissing:
        raise ShardMissing(
            f"{where} (index of rank {shard.rank}) is missing; step {m.step} is incomplete: "
            "verify with `ckptctl verify` and load an earlier step"
        ) from None
    except InvalidManifest:
        raise CorruptCheckpoint(
            f"{where} (index of rank {shard.rank}) is larger than the manifest records "
            f"({shard.index_size} bytes): it was replaced or appended to"
        ) from None
    if len(data) != shard.index_size or hashing.digest(data) != shard.index_blake3:
        raise CorruptCheckpoint(
            f"{where} (index of rank {shard.rank}) does not match the blake3 in the manifest: "
            "it was modified or comes from another step"
        )
    return parse_index(data, manifest=m, shard=shard, max_entries=max_entries, what=where)


def check_shard_size(
    storage: Storage, m: Manifest, shard: ShardInfo, dirs: OpenDirs | None = None
) -> None:
    """The shard file is there with the manifest's size (`dirs`: a caller's directories
    opened once for many shards, as `commit`'s)."""
    path = f"{layout.step_dir(m.step)}/{shard.path}"
    where = _where(storage, m.step, shard.path)
    try:
        size = storage.size(path) if dirs is None else dirs.size(storage, path)
    except ShardMissing as e:
        raise ShardMissing(
            f"{where} (rank {shard.rank} of step {m.step}) is missing: {e}"
        ) from None
    if size != shard.size:
        raise ShardSizeMismatch(
            f"{where} (rank {shard.rank} of step {m.step}) is {size} bytes, the manifest says "
            f"{shard.size}: truncated or overwritten; load an earlier step"
        )


def _check_shard_files(storage: Storage, m: Manifest, shard: ShardInfo, dirs: OpenDirs) -> None:
    """A shard and its index are there with the sizes reported (what a commit checks)."""
    check_shard_size(storage, m, shard, dirs)
    try:
        isize = dirs.size(storage, f"{layout.step_dir(m.step)}/{shard.index}")
    except ShardMissing as e:
        raise ShardMissing(
            f"{_where(storage, m.step, shard.index)} (index of rank {shard.rank} of step "
            f"{m.step}) is missing: {e}"
        ) from None
    if isize != shard.index_size:
        raise ShardSizeMismatch(
            f"{_where(storage, m.step, shard.index)} changed after it was reported"
        )


def begin_step(storage: Storage, step: int) -> None:
    """Prepare a step directory for a new save; refuse to touch a committed one."""
    sdir = layout.step_dir(step)
    if storage.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
        raise CheckpointExists(
            f"{storage.url}/{sdir} is already committed; save under a new step, "
            "or remove it first (ckptctl gc)"
        )
    if storage.exists(sdir):
        storage.remove_tree(sdir)  # debris of an earlier save of this step that never committed
    storage.makedirs(f"{sdir}/{layout.SHARDS_DIR}")


def commit(storage: Storage, m: Manifest) -> bytes:
    """Check every shard's presence and size, then write the manifest: the commit point."""
    with OpenDirs() as dirs:  # a step's shards share a directory: opened once, not per file
        for shard in m.shards:
            _check_shard_files(storage, m, shard, dirs)
    for k in m.borrows:
        if not storage.exists(f"{layout.step_dir(k)}/{layout.MANIFEST_NAME}"):
            raise CheckpointNotFound(
                f"step {m.step} borrows bytes from step {k}, which is no longer committed "
                "(removed while this save ran: gc or retention outside the coordinator); "
                "refusing to commit. Save again: the next save writes those bytes"
            )
    if sorted(s.rank for s in m.shards) != list(range(m.world_size)):
        raise CorruptCheckpoint(
            f"step {m.step}: shards of ranks {sorted(s.rank for s in m.shards)} reported, "
            f"world size is {m.world_size}; refusing to commit"
        )
    # A step is at least the version of its highest index (manifest.py): as each rank
    # reported it (the coordinator checked the report against the index), else, for an
    # index that borrows (only those can be above version 2 from a client that does not
    # report it), from the index's header.
    m.index_version = max(
        (s.index_version or (index_version(storage, m, s) if s.borrows else 0) for s in m.shards),
        default=0,
    )
    data = m.to_bytes()
    clear_stale_marker(storage, m.step)
    # Create-only: a manifest is never replaced (atomically so where the store offers it).
    # The crash point fires with the manifest's bytes durable but not yet visible.
    storage.create_only(
        f"{layout.step_dir(m.step)}/{layout.MANIFEST_NAME}",
        data,
        before_publish=lambda: crash_point("coordinator.mid_manifest"),
    )
    # The step's place on the line, known without parsing these bytes back: the next
    # save's look for the head, and retention, read them (read_lineage).
    _LINES.put(hashing.digest(data), LineStep.of(m))
    return data


_INDEX_HEAD = re.compile(rb'^\{"format":"ckptd-shard-index","version":(\d{1,3}),')


def index_version(storage: Storage, m: Manifest, shard: ShardInfo) -> int:
    """The format version of a shard's index, from its first bytes (as the writer lays
    them out), else from the whole index."""
    path = f"{layout.step_dir(m.step)}/{shard.index}"
    handle = storage.open_read(path)
    try:
        head = handle.read(0, min(96, shard.index_size)).tobytes()
    finally:
        handle.close()
    got = _INDEX_HEAD.match(head)
    if got is not None:
        return int(got.group(1))
    doc = load_index_json(storage.read_bytes(path, limit=shard.index_size), path)
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def remove_step(storage: Storage, step: int) -> None:
    """Un-publish (manifest first, so a crash leaves debris, never a half checkpoint), then delete."""
    sdir = layout.step_dir(step)
    storage.remove_tree(f"{sdir}/{layout.MANIFEST_NAME}")
    storage.remove_tree(sdir)


@dataclasses.dataclass
class VerifyReport:
    step: int
    level: str
    bytes_checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    storage: Storage,
    step: int,
    *,
    level: str = "full",
    progress: Callable[[int], None] | None = None,
    threads: int | None = None,
    manifest_blake3: str | None = None,
) -> VerifyReport:
    """Check one committed step; every problem found is reported, not just the first.

    manifest_blake3: the catalog's digest of the manifest (read_manifest)."""
    if level not in ("full", "size"):
        raise ValueError(f"level must be 'full' or 'size', got {level!r}")
    report = VerifyReport(step, level)
    try:
        m = read_manifest(storage, step, blake3=manifest_blake3)
    except CkptError as e:
        report.problems.append(str(e))
        return report
    k = knobs.get()
    keys: set[str] = set()
    for shard in m.shards:
        try:
            index = read_index(storage, m, shard, max_entries=k.max_entries_per_shard)
            keys.update(e.key for e in index.entries)
            check_shard_size(storage, m, shard)
            check_borrowed(storage, m, [index])
        except CkptError as e:
            report.problems.append(str(e))
            continue
        # Every byte the step needs: its own shard's entries, and those it borrows, read
        # from the lenders' files and checked against this index's hashes.
        by_file: dict[str, list[IndexEntry]] = {}
        for ent in index.entries:
            for p in entry_pieces(ent, m.block_size):
                by_file.setdefault(layout.job_path(step, p.file), []).append(p)
        own_path = f"{layout.step_dir(step)}/{shard.path}"
        for path, entries in by_file.items():
            if level == "full":
                problems = verify_entries(
                    storage, path, entries, m.block_size, threads=threads, progress=progress
                )
                report.problems.extend(f"rank {shard.rank}: {p}" for p in problems)
            if path != own_path:
                report.bytes_checked += sum(p.length for p in entries)
        report.bytes_checked += shard.size
    for tag, key in values.tensor_refs(m.state):
        if key not in keys and not report.problems:
            report.problems.append(
                f"step {step}: state refers to {tag} {key!r} which no shard holds"
            )
    return report
