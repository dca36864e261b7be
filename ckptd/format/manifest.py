"""Manifest and shard index: JSON, versioned, parsed defensively.

The manifest is the commit point of a step: it exists only once every shard is durable
and verified. It names each shard with its size and the blake3 of its index, so a shard
index from another step, or a consistent rewrite of a shard and its index, is detected.

Parsing never trusts storage: sizes are limited before reading, every field is
type-checked, shape products are bounded and must equal byte lengths, entries must be
aligned, in bounds and non-overlapping, and paths must stay inside the step directory.
All of this happens before any tensor memory is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import orjson

from ckptd.errors import CkptError, InvalidManifest
from ckptd.format import dtypes, hashing, layout, tensorstats, values
from ckptd.storage.paths import check_relative

FORMAT_NAME = "ckptd"
INDEX_FORMAT_NAME = "ckptd-shard-index"
# Version 2: shard files are packed (a shard holds exactly the chunks its index lists,
# each at the aligned end of the one before). Version 1 files may have holes where a
# replica written by another rank had its place; both are read.
FORMAT_VERSION = 2
# Version 3: an index entry may borrow its bytes from an earlier committed step (an
# incremental save, docs/format.md "Borrowed entries"). Written only by a step that borrows,
# so every other step stays version 2 and readable by older ckptd; those refuse version 3
# ("upgrade ckptd") rather than read a shard that lacks the borrowed bytes.
BORROWING_VERSION = 3
# Version 4: an entry's blocks may lie in several files (`borrowed_blocks`: the unchanged
# blocks of a partly changed entry name the lender's file and offset, the changed ones are
# in the step's own shard). Written only by an index that has such an entry and by the
# manifest of its step (ckptd.format.checkpoint.commit). A version-3 reader would read such
# an entry from one place; it refuses the index, and the manifest too, so that it lists
# the step as unreadable (and keeps what it may borrow) rather than judge it corrupt.
BLOCK_BORROWING_VERSION = 4
# Version 5: an entry starts at any ENTRY_ALIGN boundary less than `alignment` bytes past the
# end of the one before (versions 2 to 4: exactly at that end rounded up to `alignment`),
# so that its place in a page of the file is its memory's place in a page: O_DIRECT then
# takes a tensor's bytes straight from it, where a page-aligned offset needs a copy of every
# byte (torch's large CPU tensors start 64 bytes into a page). Written only by an index with
# such an offset (ShardIndex.version) and by the manifest of its step; a reader of version 4
# would refuse the index and judge the step corrupt, so it refuses the manifest instead.
PHASED_VERSION = 5
READ_VERSIONS = (1, 2, 3, 4, 5)
ENTRY_ALIGN = 64  # every offset of a version-5 index: any dtype's elements stay aligned
MAX_DIMS = values.MAX_DIMS  # one limit for entries' shapes and views' strides
MAX_KEY_LEN = 4096
MAX_ELEMENTS = 1 << 62


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """Blocks [block, block + count) of an entry, stored in `file` (a lender's shard, as
    `../step-N/shards/...`) from byte `offset`, one after another."""

    block: int
    count: int
    file: str
    offset: int

    def to_json(self) -> list[Any]:
        return [self.block, self.count, self.file, self.offset]


@dataclasses.dataclass
class IndexEntry:
    """One tensor chunk in a shard file."""

    key: str
    dtype: str
    shape: list[int]  # global shape of the tensor
    chunk_offsets: list[int]  # where this chunk starts in the global tensor
    chunk_sizes: list[int]  # the chunk's own shape
    offset: int  # byte offset in the shard file (aligned)
    length: int  # byte length
    blake3: list[str]  # one digest per block of `block_size`, relative to `offset`
    file: str = ""  # shard path relative to the step directory (`../step-N/...`: borrowed)
    # Health of a floating-point chunk (optional: None in indexes written before it was
    # recorded, or with the health_stats knob off); ckptd.format.tensorstats.
    stats: tensorstats.TensorStats | None = None
    # Format version 4: the entry's blocks stored in a lender's file (ascending, disjoint);
    # every other block is in `file` (this step's shard) from `offset`, in block order.
    # Empty: all of the entry is at `file`/`offset`. See `entry_pieces`. The empty tuple,
    # not a list: a list an entry was one more object alive through every save and parse
    # (Python's collector counts them; bench/README.md, twenty-seventh pass).
    borrowed_blocks: Sequence[BlockRun] = ()
    # Not stored: when this entry is one piece of a larger one (entry_pieces), the larger
    # one's block number of blake3[0] (errors name the block as the index counts it) and
    # the byte of the larger entry where this piece begins.
    first_block: int = 0
    start: int = 0

    @property
    def lenders(self) -> list[int]:
        """The steps whose files hold any of this entry's bytes, besides its own (ascending)."""
        if not self.borrowed_blocks:  # one file: asked per entry of every index written or read
            lent = layout.split_borrowed(self.file)
            return [] if lent is None else [lent[0]]
        files = (self.file, *(r.file for r in self.borrowed_blocks))
        return sorted({lent[0] for f in files if (lent := layout.split_borrowed(f)) is not None})

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "key": self.key,
            "dtype": self.dtype,
            "shape": self.shape,
            "chunk_offsets": self.chunk_offsets,
            "chunk_sizes": self.chunk_sizes,
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "blake3": self.blake3,
        }
        if self.stats is not None:
            doc["stats"] = self.stats.to_json()
        if self.borrowed_blocks:
            doc["borrowed_blocks"] = [r.to_json() for r in self.borrowed_blocks]
        return doc

    @property
    def is_full(self) -> bool:
        return self.chunk_sizes == self.shape and not any(self.chunk_offsets)


@dataclasses.dataclass
class ShardIndex:
    job: str
    step: int
    generation: int
    rank: int
    world_size: int
    shard: str
    shard_size: int
    block_size: int
    alignment: int
    entries: list[IndexEntry]

    @property
    def version(self) -> int:
        """The lowest format version that can say what this index says."""
        align = self.alignment
        if any(
            e.offset % align or any(r.offset % align for r in e.borrowed_blocks)
            for e in self.entries
        ):
            return PHASED_VERSION
        if any(e.borrowed_blocks for e in self.entries):
            return BLOCK_BORROWING_VERSION
        if any(e.lenders for e in self.entries):
            return BORROWING_VERSION
        return FORMAT_VERSION

    def to_bytes(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT_NAME,
            "version": self.version,
            "job": self.job,
            "step": self.step,
            "generation": self.generation,
            "rank": self.rank,
            "world_size": self.world_size,
            "shard": self.shard,
            "shard_size": self.shard_size,
            "block_size": self.block_size,
            "alignment": self.alignment,
            "hash": hashing.HASH_NAME,
            "entries": [e.to_json() for e in self.entries],
        }
        # orjson: a tenth of json's time for an index, on every save's path to its commit.
        # It would write a NaN or an Infinity as null; the index's only floats are its
        # entries' stats, which TensorStats.to_json refuses unless finite.
        return orjson.dumps(doc)


@dataclasses.dataclass
class ShardInfo:
    rank: int
    path: str
    size: int
    index: str
    index_size: int
    index_blake3: str
    # The steps whose files this shard's index borrows entries from (ascending; empty: a
    # self-contained shard, and the field is not written).
    borrows: list[int] = dataclasses.field(default_factory=list)
    # The format version of the index, as its writer reported it (0: not known); not a
    # field of the manifest's record: the manifest's own version is at least it (commit).
    index_version: int = dataclasses.field(default=0, compare=False)

    def to_json(self) -> dict[str, Any]:
        # Spelled out, not dataclasses.asdict: a manifest has one of these per rank (its
        # recursive copy was a tenth of a 4,096-rank commit's coordinator time).
        doc: dict[str, Any] = {
            "rank": self.rank,
            "path": self.path,
            "size": self.size,
            "index": self.index,
            "index_size": self.index_size,
            "index_blake3": self.index_blake3,
        }
        if self.borrows:
            doc["borrows"] = list(self.borrows)
        return doc


@dataclasses.dataclass
class Manifest:
    job: str
    step: int
    generation: int
    world_size: int
    block_size: int
    alignment: int
    shards: list[ShardInfo]
    state: Any  # node tree (ckptd.format.values)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    created_unix: float = dataclasses.field(default_factory=time.time)
    # The step this state descends from (the job's last save or load before it); None:
    # not recorded (a job's first save, or a manifest written before lineage was).
    parent: int | None = None
    # The highest format version of its shard indexes, when known (not a field of its own:
    # the manifest's version is at least this; set at commit, and by parsing).
    index_version: int = 0

    @property
    def borrows(self) -> list[int]:
        """Every step this step borrows bytes from (ascending): retention keeps them while
        this step is kept (ckptd.coordinator.retention)."""
        return sorted({k for s in self.shards for k in s.borrows})

    def to_bytes(self) -> bytes:
        version = max(FORMAT_VERSION, BORROWING_VERSION if self.borrows else 0, self.index_version)
        doc = {
            "format": FORMAT_NAME,
            "version": version,
            "job": self.job,
            "step": self.step,
            "generation": self.generation,
            "world_size": self.world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "created_unix": self.created_unix,
            "parent": self.parent,
            "block_size": self.block_size,
            "alignment": self.alignment,
            "hash": hashing.HASH_NAME,
            "metadata": self.metadata,
            "shards": [s.to_json() for s in self.shards],
            "state": self.state,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


# ----------------------------------------------------------------------------- parsing


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(data: bytes, what: str, *, index: bool = False) -> Any:
    """Strict JSON (no NaN or Infinity), errors as InvalidManifest naming `what`.

    index: the bytes are a shard index, where every integer the parser accepts fits in
    64 bits. orjson (three times json's pace on an index, which the coordinator parses
    for every rank at every save) reads it then; it reads a larger integer as a float,
    which the index's checks refuse as they refuse the integer. What orjson refuses
    (NaN, a number beyond a float, a byte-order mark, nesting past 1024) goes to json,
    which accepts or refuses it, and says why, as it always has."""
    if index:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidManifest(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidManifest(f"{what}: not valid JSON ({e})") from None


def _field(doc: dict[str, Any], name: str, kind: type | tuple[type, ...], what: object) -> Any:
    if name not in doc:
        raise InvalidManifest(f"{what}: missing field {name!r}")
    v = doc[name]
    if (
        isinstance(v, bool)
        and kind is not bool
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise InvalidManifest(f"{what}: field {name!r} must be {_kind_name(kind)}, got a bool")
    if not isinstance(v, kind):
        raise InvalidManifest(
            f"{what}: field {name!r} must be {_kind_name(kind)}, got {type(v).__name__}"
        )
    return v


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


_NONNEG_END = 1 << 63  # _nonneg's default upper bound


def _nonneg(doc: dict[str, Any], name: str, what: object, upper: int = _NONNEG_END) -> int:
    v = _field(doc, name, int, what)
    if not 0 <= v < upper:
        raise InvalidManifest(f"{what}: field {name!r}={v} out of range [0, {upper})")
    return int(v)


def _int_list(v: Any, name: str, what: object) -> list[int]:
    # Exact types: a JSON number without a fraction is an int, never a bool (one per
    # dimension of every entry of an index, so the cheapest test that is exact).
    if type(v) is not list or len(v) > MAX_DIMS:
        raise InvalidManifest(f"{what}: {name} must be a list of at most {MAX_DIMS} integers")
    for x in v:
        if type(x) is not int or not 0 <= x < MAX_ELEMENTS:
            raise InvalidManifest(f"{what}: {name} has an invalid dimension {x!r}")
    return v  # the parse's own list, checked: a copy was one more list alive an entry


def _check_header(doc: Any, fmt: str, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise InvalidManifest(f"{what}: top level must be a JSON object")
    if doc.get("format") != fmt:
        raise InvalidManifest(f"{what}: not a {fmt} file (format={doc.get('format')!r})")
    version = doc.get("version")
    versions = READ_VERSIONS
    if isinstance(version, bool) or version not in versions:
        raise InvalidManifest(
            f"{what}: format version {version!r} is not supported by this ckptd "
            f"(it reads versions {', '.join(map(str, versions))}); upgrade ckptd to read it"
        )
    if doc.get("hash", hashing.HASH_NAME) != hashing.HASH_NAME:
        raise InvalidManifest(f"{what}: unknown hash {doc.get('hash')!r}")
    return doc


def _check_block_size(doc: dict[str, Any], what: str) -> tuple[int, int]:
    block = _nonneg(doc, "block_size", what)
    align = _nonneg(doc, "alignment", what)
    if block < 4096 or block > (1 << 34) or align < 1 or align > (1 << 24) or align & (align - 1):
        raise InvalidManifest(f"{what}: block_size {block} / alignment {align} out of range")
    return block, align


# The manifests whose state tree passed values.check_node, by the blake3 of their bytes:
# the verdict is a function of the bytes, and a save's or a load's search for the live
# line's head parses every kept step's manifest each time (the tree's check is most of a
# parse; bench/README.md, issue 16 tenth pass).
_CHECKED_STATES: hashing.DigestMemo[bool] = hashing.DigestMemo(4096)


def _check_state(data: bytes, state: Any) -> None:
    """values.check_node(state), skipped for manifest bytes whose tree already passed."""
    digest = hashing.digest(data)
    if _CHECKED_STATES.get(digest):
        return
    values.check_node(state)
    _CHECKED_STATES.put(digest, True)


def parse_manifest(data: bytes, *, what: str = "MANIFEST.json") -> Manifest:
    doc = _check_header(_loads(data, what), FORMAT_NAME, what)
    try:
        step = layout.check_step(doc.get("step"))
    except ValueError as e:
        raise InvalidManifest(f"{what}: {e}") from None
    what = f"{what} (step {step})"
    job = _field(doc, "job", str, what)
    if len(job) > MAX_KEY_LEN or "\0" in job:
        raise InvalidManifest(f"{what}: job is over {MAX_KEY_LEN} characters or contains NUL")
    generation = _nonneg(doc, "generation", what)
    world_size = _nonneg(doc, "world_size", what, upper=layout.MAX_RANK + 2)
    if world_size < 1:
        raise InvalidManifest(f"{what}: world_size must be at least 1")
    block, align = _check_block_size(doc, what)
    created = _field(doc, "created_unix", (int, float), what)
    if not 0 <= created < 1e11:
        raise InvalidManifest(f"{what}: created_unix {str(created)[:40]} is not a plausible time")
    metadata = _field(doc, "metadata", dict, what)
    parent = doc.get("parent")  # optional: manifests before lineage have none
    if parent is not None:
        try:
            parent = layout.check_step(parent)
        except ValueError as e:
            raise InvalidManifest(f"{what}: parent: {e}") from None
    shards_doc = _field(doc, "shards", list, what)
    shards: list[ShardInfo] = []
    seen_ranks: set[int] = set()
    seen_paths: set[str] = set()
    for i, s in enumerate(shards_doc):
        sw = f"{what} shard #{i}"
        if not isinstance(s, dict):
            raise InvalidManifest(f"{sw}: must be an object")
        rank = _nonneg(s, "rank", sw, upper=world_size)
        path = check_relative(_field(s, "path", str, sw), what=f"{sw} path")
        index = check_relative(_field(s, "index", str, sw), what=f"{sw} index")
        digest = _field(s, "index_blake3", str, sw)
        if not hashing.is_hex_digest(digest):
            raise InvalidManifest(f"{sw}: index_blake3 is not a blake3 hex digest")
        if rank in seen_ranks or path in seen_paths or index in seen_paths:
            raise InvalidManifest(f"{sw}: rank {rank} or path {path!r} appears twice")
        seen_ranks.add(rank)
        seen_paths.update((path, index))
        borrows = _borrows(s, step, doc["version"], sw)
        shards.append(
            ShardInfo(
                rank=rank,
                path=path,
                size=_nonneg(s, "size", sw),
                index=index,
                index_size=_nonneg(s, "index_size", sw),
                index_blake3=digest,
                borrows=borrows,
            )
        )
    state = doc.get("state")
    _check_state(data, state)
    return Manifest(
        job=job,
        step=step,
        generation=generation,
        world_size=world_size,
        block_size=block,
        alignment=align,
        shards=shards,
        state=state,
        metadata=metadata,
        created_unix=float(created),
        parent=parent,
        index_version=doc["version"],
    )


def _borrows(s: dict[str, Any], step: int, version: int, what: str) -> list[int]:
    """A shard's optional `borrows`: distinct steps other than its own, ascending."""
    got = s.get("borrows")
    if got is None:
        return []
    if version < BORROWING_VERSION:
        raise InvalidManifest(
            f"{what}: borrows other steps' bytes, which format version {version} cannot "
            f"(version {BORROWING_VERSION} and later)"
        )
    if not isinstance(got, list) or len(got) > 1 << 16:
        raise InvalidManifest(f"{what}: borrows must be a list of steps")
    out = []
    for k in got:
        try:
            out.append(layout.check_step(k))
        except ValueError as e:
            raise InvalidManifest(f"{what}: borrows: {e}") from None
    if out != sorted(set(out)) or step in out:
        raise InvalidManifest(
            f"{what}: borrows {out[:8]} must be distinct steps in ascending order, not the "
            f"step's own ({step})"
        )
    return out


def load_index_json(data: bytes, what: str) -> Any:
    """A shard index's JSON (strict: no NaN/Infinity), errors as InvalidManifest naming
    `what`, for parse_index(doc=...)."""
    return _loads(data, what, index=True)


def parse_index(
    data: bytes | None,
    *,
    manifest: Manifest,
    shard: ShardInfo,
    max_entries: int,
    what: str,
    doc: Any = None,
) -> ShardIndex:
    """Parse and cross-check one shard index against its manifest entry.

    doc: the index already decoded with load_index_json (a caller that needed a field first),
    so the bytes are not parsed twice.
    """
    if doc is None:
        assert data is not None
        doc = _loads(data, what, index=True)
    doc = _check_header(doc, INDEX_FORMAT_NAME, what)
    if doc["version"] > manifest.index_version > 0:  # a parsed manifest's: bounds its indexes
        raise InvalidManifest(
            f"{what}: format version {doc['version']}, but the manifest of step "
            f"{manifest.step} is version {manifest.index_version}: one of them was altered"
        )
    checks = {
        "step": manifest.step,
        "rank": shard.rank,
        "generation": manifest.generation,
        "world_size": manifest.world_size,
        "shard": shard.path,
        "shard_size": shard.size,
        "block_size": manifest.block_size,
        "alignment": manifest.alignment,
    }
    for name, want in checks.items():
        got = doc.get(name)
        if got != want or isinstance(got, bool):
            raise InvalidManifest(
                f"{what}: {name} is {got!r} but the manifest says {want!r} "
                "(an index from another step, rank or save?)"
            )
    entries_doc = _field(doc, "entries", list, what)
    if len(entries_doc) > max_entries:
        raise InvalidManifest(
            f"{what}: {len(entries_doc)} entries, over the limit of {max_entries} "
            "(raise CKPT_MAX_ENTRIES_PER_SHARD if genuine)"
        )
    block = manifest.block_size
    entries = []
    # A shard may hold several chunks of one key (a DCP rank with several local shards of
    # a tensor), each once: whether a key's boxes tile its shape is the coordinator's
    # check at save time (planning) and the reader's at load time (boxes.plan_box).
    boxes: set[tuple[str, tuple[int, ...]]] = set()
    for i, e in enumerate(entries_doc):
        entry = _parse_entry(
            e, i, block, manifest.alignment, shard, what, manifest.step, doc["version"]
        )
        box = (entry.key, tuple(entry.chunk_offsets))
        if box in boxes:
            raise InvalidManifest(
                f"{what}: key {entry.key!r} chunk at {list(entry.chunk_offsets)} appears "
                "twice in one shard"
            )
        boxes.add(box)
        entries.append(entry)
    # Borrowed bytes (whole entries, or blocks of one) name other steps' files: what they
    # borrow must be what the manifest says the shard borrows (retention keeps exactly those
    # steps), and where the bytes lie in those files is checked against their steps when the
    # step is opened (checkpoint.check_borrowed).
    lent = sorted({k for e in entries for k in e.lenders})
    if lent and doc["version"] < BORROWING_VERSION:
        raise InvalidManifest(
            f"{what}: entries borrow from steps {lent[:8]}, which format version "
            f"{doc['version']} cannot (version {BORROWING_VERSION} and later)"
        )
    if lent != list(shard.borrows):
        raise InvalidManifest(
            f"{what}: entries borrow from steps {lent[:8]}, the manifest says rank "
            f"{shard.rank} borrows from {list(shard.borrows)[:8]}: the index or the manifest "
            "was altered; load an earlier step"
        )
    # Non-overlapping, in bounds: the bytes each entry holds in this shard.
    own = [p for e in entries if (p := own_part(e, block)) is not None]
    end = 0
    for e in sorted(own, key=lambda x: x.offset):
        if e.offset < end:
            raise InvalidManifest(
                f"{what}: entry {e.key!r} at byte {e.offset} overlaps the previous entry"
            )
        end = e.offset + e.length
        if end > shard.size:
            raise InvalidManifest(
                f"{what}: entry {e.key!r} ends at byte {end}, past the shard's {shard.size} bytes"
            )
    if doc["version"] >= 2:
        gap = packing_gap(own, shard.size, manifest.alignment, doc["version"])
        if gap is not None:
            raise InvalidManifest(
                f"{what}: shard {shard.path!r} is not packed ({gap}), but a version-"
                f"{doc['version']} shard holds only its entries, each at the aligned end of "
                "the one before: the index or the shard was altered; load an earlier step"
            )
    return ShardIndex(
        job=str(doc.get("job", "")),
        step=manifest.step,
        generation=manifest.generation,
        rank=shard.rank,
        world_size=manifest.world_size,
        shard=shard.path,
        shard_size=shard.size,
        block_size=block,
        alignment=manifest.alignment,
        entries=entries,
    )


def entry_pieces(e: IndexEntry, block: int) -> list[IndexEntry]:
    """Where the bytes of entry `e` are stored, in the entry's order: the one rule every
    reader follows (load, resharding load, the shared read plan, verify, diff, export,
    restore, inspect, mirror, the next incremental save).

    Each piece is an entry of the file that holds it: its `file` (relative to the entry's
    step directory, `../step-N/...` for a lender's), `offset` and `length` there, the hashes
    of its blocks, and `first_block` / `start`, where it begins in `e`. An entry without
    `borrowed_blocks` is one piece, itself (its own shard's bytes, or a lender's: a whole
    borrowed entry). Otherwise the runs name the lender's blocks and every other block lies
    in `e.file` (the step's own shard) from `e.offset`, in block order.
    """
    if not e.borrowed_blocks:
        return [e]
    out: list[IndexEntry] = []

    def piece(b0: int, b1: int, file: str, offset: int) -> IndexEntry:
        lo, hi = b0 * block, min(b1 * block, e.length)
        return dataclasses.replace(
            e,
            file=file,
            offset=offset,
            length=hi - lo,
            blake3=e.blake3[b0:b1],
            stats=None,
            borrowed_blocks=(),
            first_block=b0,
            start=lo,
        )

    at, b = e.offset, 0
    for r in e.borrowed_blocks:
        if r.block > b:
            out.append(piece(b, r.block, e.file, at))
            at += out[-1].length
        out.append(piece(r.block, r.block + r.count, r.file, r.offset))
        b = r.block + r.count
    n = hashing.n_blocks(e.length, block)
    if b < n:
        out.append(piece(b, n, e.file, at))
    return out


def own_part(e: IndexEntry, block: int) -> IndexEntry | None:
    """The bytes entry `e` holds in its own step's shard, as one range (the pieces there are
    contiguous); None when it holds none there (all of it is borrowed)."""
    if not e.borrowed_blocks:
        return None if e.lenders else e
    n = e.length - sum(p.length for p in entry_pieces(e, block) if p.file != e.file)
    return dataclasses.replace(e, length=n, borrowed_blocks=()) if n else None


def packing_gap(
    entries: list[IndexEntry], size: int, align: int, version: int = FORMAT_VERSION
) -> str | None:
    """Where `entries` fail to tile a shard file of `size` bytes, or None when they do.

    Packed (format version 2): in offset order every entry starts at the end of the one
    before rounded up to `align` (the first at 0), and the file ends at the last entry's
    end rounded up; the only bytes no entry holds are that alignment padding. Version 5
    (PHASED_VERSION): an entry starts less than `align` bytes past the end of the one
    before (the first: past 0), the padding before it chosen by the writer.
    """
    end = 0
    for e in sorted(entries, key=lambda x: (x.offset, x.length)):
        packed = -(-end // align) * align
        ok = end <= e.offset < end + align if version >= PHASED_VERSION else e.offset == packed
        if not ok:
            return f"entry {e.key!r} starts at byte {e.offset}, the packed place is {packed}"
        end = e.offset + e.length
    end = -(-end // align) * align
    if size != end:
        return f"the file is {size} bytes, its entries end at {end} (aligned)"
    return None


class _EntryWhere:
    """An entry's place in an index for its errors (`what` key 'k', or `what` entry #i
    before its key is known), formatted only when an error is raised: an index has an
    entry per chunk, and each is parsed at every save's check and every load."""

    __slots__ = ("what", "i", "key")

    def __init__(self, what: str, i: int):
        self.what, self.i = what, i
        self.key: str | None = None

    def __str__(self) -> str:
        if self.key is None:
            return f"{self.what} entry #{self.i}"
        return f"{self.what} key {self.key!r}"


def _parse_entry(
    e: Any, i: int, block: int, align: int, shard: ShardInfo, what: str, step: int, version: int
) -> IndexEntry:
    # Each field's common case (an exact str, or an int in range) is tested inline, and
    # anything else goes to the helper that says what is wrong (or accepts a subclass):
    # the helpers are the rules; the inline tests only skip a call for what they accept.
    # This runs for every entry of every rank's index at each save's check (thousands of
    # entries a rank at scale) and each load.
    ew = _EntryWhere(what, i)
    if not isinstance(e, dict):
        raise InvalidManifest(f"{ew}: must be an object")
    get = e.get
    key = get("key")
    if type(key) is not str:
        key = _field(e, "key", str, ew)
    if not key or len(key) > MAX_KEY_LEN or "\0" in key:
        raise InvalidManifest(f"{ew}: key must be 1..{MAX_KEY_LEN} characters without NUL")
    ew.key = key
    dtype = get("dtype")
    if type(dtype) is not str:
        dtype = _field(e, "dtype", str, ew)
    try:
        size = dtypes.itemsize(dtype)
    except KeyError as err:
        raise InvalidManifest(f"{ew}: {err.args[0]}") from None
    shape = _int_list(get("shape"), "shape", ew)
    offs = _int_list(get("chunk_offsets"), "chunk_offsets", ew)
    sizes = _int_list(get("chunk_sizes"), "chunk_sizes", ew)
    if not len(shape) == len(offs) == len(sizes):
        raise InvalidManifest(f"{ew}: shape, chunk_offsets and chunk_sizes differ in rank")
    numel = 1
    for d in range(len(sizes)):
        n, o, s = shape[d], offs[d], sizes[d]
        if o + s > n:
            raise InvalidManifest(f"{ew}: chunk [{o}, {o + s}) exceeds dimension {d} of size {n}")
        numel *= s
        if numel > MAX_ELEMENTS:
            raise InvalidManifest(f"{ew}: chunk has more than 2**62 elements")
    if len(shape) > 1 and math.prod(shape) > MAX_ELEMENTS:
        raise InvalidManifest(f"{ew}: global shape has more than 2**62 elements")
    length = get("length")
    if type(length) is not int or not 0 <= length < _NONNEG_END:
        length = _nonneg(e, "length", ew)
    if length != numel * size:
        raise InvalidManifest(
            f"{ew}: length {length} != {numel} elements x {size} bytes of {dtype}"
        )
    offset = get("offset")
    if type(offset) is not int or not 0 <= offset < _NONNEG_END:
        offset = _nonneg(e, "offset", ew)
    if version >= PHASED_VERSION:
        align = ENTRY_ALIGN
    if offset % align:
        raise InvalidManifest(f"{ew}: offset {offset} is not {align}-byte aligned")
    file = get("file", shard.path)
    lent = None
    # The shard's own path, which its manifest entry (or the coordinator's assignment)
    # has already confined, is the common case: no pattern to match per entry.
    if file != shard.path:
        lent = layout.split_borrowed(file) if isinstance(file, str) else None
        if lent is None:
            check_relative(file, what=f"{ew} file")
            raise InvalidManifest(f"{ew}: file {file!r} is not this index's shard {shard.path!r}")
        _check_lender_file(file, step, ew)
    digests = get("blake3")
    if not isinstance(digests, list) or len(digests) != hashing.n_blocks(length, block):
        raise InvalidManifest(f"{ew}: expected {hashing.n_blocks(length, block)} block hashes")
    if not hashing.all_hex_digests(digests):
        raise InvalidManifest(f"{ew}: block hashes must be blake3 hex digests")
    stats = tensorstats.parse(get("stats"), dtype=dtype, numel=numel, what=ew)
    runs = _borrowed_blocks(e, len(digests), align, step, version, ew)
    if runs and lent is not None:
        raise InvalidManifest(
            f"{ew}: borrows blocks, so its file must be this index's shard {shard.path!r}, "
            f"not {file!r}"
        )
    return IndexEntry(key, dtype, shape, offs, sizes, offset, length, digests, file, stats, runs)


def _check_lender_file(file: str, step: int, what: object) -> None:
    """A lender's file as an entry names it: `../step-N/shards/...`, N not the entry's
    own step, the rest confined like every format path (no `..`, no absolute path)."""
    lent = layout.split_borrowed(file)
    if lent is None:
        raise InvalidManifest(
            f"{what}: file {file!r} must name a shard of another step (../step-N/shards/...)"
        )
    check_relative(lent[1], what=f"{what} file")
    if lent[0] == step or not lent[1].startswith(f"{layout.SHARDS_DIR}/"):
        raise InvalidManifest(
            f"{what}: file {file!r} must name a shard of another step (../step-N/shards/...)"
        )


def _borrowed_blocks(
    e: dict[str, Any], n_blocks: int, align: int, step: int, version: int, what: object
) -> Sequence[BlockRun]:
    """An entry's optional `borrowed_blocks` (format version 4): runs
    [first block, block count, lender's file, offset there], ascending and disjoint, inside
    the entry's blocks."""
    got = e.get("borrowed_blocks")
    if got is None:
        return ()
    if version < BLOCK_BORROWING_VERSION:
        raise InvalidManifest(
            f"{what}: borrows blocks, which format version {version} cannot (version "
            f"{BLOCK_BORROWING_VERSION} and later)"
        )
    if not isinstance(got, list) or not got or len(got) > n_blocks:
        raise InvalidManifest(
            f"{what}: borrowed_blocks must be a list of 1 to {n_blocks} runs (one per block at most)"
        )
    out: list[BlockRun] = []
    end = 0
    for run in got:
        ok = isinstance(run, list) and len(run) == 4 and isinstance(run[2], str)
        nums = [run[0], run[1], run[3]] if ok else []
        if not ok or any(isinstance(x, bool) or not isinstance(x, int) for x in nums):
            raise InvalidManifest(
                f"{what}: a borrowed_blocks run must be [first block, count, file, offset], "
                f"got {str(run)[:80]}"
            )
        b, n, file, offset = run
        if b < end or n < 1 or b + n > n_blocks:
            raise InvalidManifest(
                f"{what}: borrowed blocks {b}..{b + n} are not ascending, disjoint runs "
                f"inside the entry's {n_blocks} blocks"
            )
        _check_lender_file(file, step, what)
        if not 0 <= offset < (1 << 63) or offset % align:
            raise InvalidManifest(
                f"{what}: borrowed blocks {b}..{b + n} at byte {offset} of {file!r}: not a "
                f"{align}-byte aligned offset"
            )
        out.append(BlockRun(b, n, file, offset))
        end = b + n
    return out


def describe(err: CkptError, **ctx: Any) -> str:
    """Prefix an error message with job/step/rank/file context."""
    parts = [f"{k}={v}" for k, v in ctx.items() if v is not None]
    return f"[{' '.join(parts)}] {err}" if parts else str(err)
