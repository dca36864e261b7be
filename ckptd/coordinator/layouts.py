"""Plan layouts cached across steps: an unchanged layout travels as its digest.

A rank's layout is its plan without the bytes: per chunk, in order, the key, dtype,
global shape, chunk offsets and sizes (the length follows from them). Saves of one model
under one sharding have the same layout step after step, so a rank whose plan has the
layout of one the coordinator accepted from it before sends only the layout's digest and
its chunks' digests (32 raw bytes each). The digest is blake3 of a canonical encoding
(`layout_digest`), computed alike by the client (to claim it) and by the coordinator (to
check a claim that came with the whole plan, before remembering it).

`LayoutCache` is the coordinator's memory of them: per (job, rank) the last
LAYOUTS_PER_RANK layouts it parsed and checked, as the parts they arrived in, at most
MAX_CACHED_CHUNKS chunks in all (least recently used (job, rank) first out; about 0.5 KiB
a chunk). A cached plan is rebuilt from the held chunks with the new digests, without
parsing or checking them again. Per job it also holds the last assignment and the ranks'
layouts it was made for: a save of the same layouts on every rank skips the tiling
checks and the balance, and only compares the replicas' hashes (planning.assign). A digest it does not hold (the coordinator restarted, or
evicted it) is LayoutUnknown, not a failure of the save: the client sends the whole plan.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Sequence

import blake3

from ckptd.coordinator.planning import Assignment, ChunkPlan
from ckptd.errors import InvalidRequest, LayoutUnknown

DIGEST_BYTES = 32
LAYOUTS_PER_RANK = 2  # this step's and the last one's: a model that alternates two layouts
MAX_CACHED_CHUNKS = 4 << 20  # ~2 GiB at most; 16,384 ranks x 256 chunks fit
MAX_ASSIGNED_JOBS = 16  # jobs whose last assignment is held (one per job)
_MAGIC = b"ckptd-layout-v1\0"


def layout_digest(chunks: Sequence[ChunkPlan]) -> bytes:
    """blake3 of the layout of `chunks`: count, then per chunk the key (length-prefixed
    UTF-8), the dtype, the number of dimensions and shape, offsets and sizes as u64, all
    little-endian. Two plans have the same digest iff they name the same boxes in order."""
    h = blake3.blake3(_MAGIC + struct.pack("<Q", len(chunks)))
    for c in chunks:
        key, dtype, n = c.key.encode("utf-8", "surrogatepass"), c.dtype.encode(), len(c.shape)
        h.update(struct.pack(f"<I{len(key)}sB{len(dtype)}sB", len(key), key, len(dtype), dtype, n))
        h.update(struct.pack(f"<{3 * n}Q", *c.shape, *c.chunk_offsets, *c.chunk_sizes))
    return h.digest()


def check_fields(layout: bytes, digests: bytes, cached: bool, where: str) -> None:
    """A BeginSave's layout_digest and digests fields, before anything is looked up."""
    if len(layout) not in (0, DIGEST_BYTES) or (digests and not cached):
        raise InvalidRequest(
            f"{where}: layout_digest must be {DIGEST_BYTES} bytes ({len(layout)} sent), and "
            "digests come only with a cached plan (a layout_digest and no chunks)"
        )


def split_digests(data: bytes, count: int, where: str) -> list[str]:
    """`count` chunk digests from their concatenated raw bytes, as the hex ChunkPlan holds."""
    if len(data) % DIGEST_BYTES or len(data) // DIGEST_BYTES != count:
        raise InvalidRequest(
            f"{where}: the cached plan's digests are {len(data)} bytes; its layout has {count} "
            f"chunk(s) in this part, so they must be {count} x {DIGEST_BYTES} bytes (field "
            "digests)"
        )
    return [data[i : i + DIGEST_BYTES].hex() for i in range(0, len(data), DIGEST_BYTES)]


@dataclasses.dataclass(frozen=True)
class Layout:
    parts: tuple[tuple[ChunkPlan, ...], ...]  # checked chunks, as the whole plan's parts

    @property
    def chunks(self) -> int:
        return sum(len(p) for p in self.parts)


class LayoutCache:
    """The layouts the coordinator accepted, per (job, rank); see the module docstring."""

    def __init__(self, per_rank: int = LAYOUTS_PER_RANK, max_chunks: int = MAX_CACHED_CHUNKS):
        self.per_rank, self.max_chunks = per_rank, max_chunks
        self._held: collections.OrderedDict[
            tuple[str, int], collections.OrderedDict[bytes, Layout]
        ] = collections.OrderedDict()
        self.chunks = 0
        self._assigned: collections.OrderedDict[str, tuple[tuple[bytes, ...], Assignment]] = (
            collections.OrderedDict()
        )

    def assigned(self, job: str, key: tuple[bytes, ...] | None) -> Assignment | None:
        """The job's last assignment when its ranks' layouts (`key`, in rank order) were
        these: planning.assign reuses its tiling and balance (`reuse=`)."""
        held = self._assigned.get(job)
        return held[1] if key is not None and held is not None and held[0] == key else None

    def keep_assigned(self, job: str, key: tuple[bytes, ...] | None, a: Assignment) -> None:
        if key is None or a.replicas is None:
            return
        self._assigned[job] = (key, a)
        self._assigned.move_to_end(job)
        while len(self._assigned) > MAX_ASSIGNED_JOBS:
            self._assigned.popitem(last=False)

    def accept(
        self, job: str, rank: int, claimed: bytes, parts: Sequence[Sequence[ChunkPlan]], where: str
    ) -> None:
        """Hold a whole (checked) plan's layout, once its digest is the one the rank
        claimed: a client that lies, or encodes layouts otherwise than this coordinator,
        would have its cached plans name other boxes than it holds."""
        got = layout_digest([c for p in parts for c in p])
        if got != claimed:
            raise InvalidRequest(
                f"{where}: the plan's layout digest is {got.hex()[:16]}, the rank claimed "
                f"{claimed.hex()[:16]} (field layout_digest): the client computes layouts "
                "otherwise than this coordinator (versions differ?) or its plan is corrupt"
            )
        self.remember(job, rank, got, parts)

    def remember(
        self, job: str, rank: int, digest: bytes, parts: Sequence[Sequence[ChunkPlan]]
    ) -> None:
        held = self._held.setdefault((job, rank), collections.OrderedDict())
        self._held.move_to_end((job, rank))
        if digest in held:
            held.move_to_end(digest)
            return
        layout = held[digest] = Layout(tuple(tuple(p) for p in parts))
        self.chunks += layout.chunks
        while len(held) > self.per_rank:
            self.chunks -= held.popitem(last=False)[1].chunks
        while self.chunks > self.max_chunks and len(self._held) > 1:
            _, old = self._held.popitem(last=False)
            self.chunks -= sum(x.chunks for x in old.values())

    def holds(self, job: str, rank: int, digest: bytes) -> bool:
        held = self._held.get((job, rank))
        return held is not None and digest in held

    def plan(
        self,
        job: str,
        rank: int,
        digest: bytes,
        part: int,
        parts: int,
        digests: bytes,
        where: str,
    ) -> list[ChunkPlan]:
        """Part `part` of the cached plan: the held layout's chunks with `digests`."""
        held = self._held.get((job, rank))
        layout = held.get(digest) if held is not None else None
        if layout is None:
            raise LayoutUnknown(
                f"{where}: this coordinator does not hold layout {digest.hex()[:16]} (it "
                "restarted or evicted it); send the whole plan"
            )
        self._held.move_to_end((job, rank))
        if parts != len(layout.parts):
            raise InvalidRequest(
                f"{where}: the cached plan comes in {parts} part(s); its layout "
                f"{digest.hex()[:16]} was sent in {len(layout.parts)}"
            )
        chunks = layout.parts[part]
        hexes = split_digests(digests, len(chunks), where)
        return [
            ChunkPlan(c.key, c.dtype, c.shape, c.chunk_offsets, c.chunk_sizes, c.length, h)
            for c, h in zip(chunks, hexes, strict=True)
        ]
