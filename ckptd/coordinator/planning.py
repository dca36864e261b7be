"""Who writes what: dedup of replicated chunks, divergence checks, state merging.

Pure functions over the plans of all ranks (no I/O, no transport), so the rules are
easy to test. The rules:

- Chunks are identified by (key, chunk box). Several ranks holding the same chunk are
  replicas (the DDP case, or a DTensor's Replicate dimension): it is written once, by the
  holder with the fewest bytes assigned so far (largest chunks placed first), so write
  load spreads across ranks.
- Replicas must have equal hashes, dtypes and shapes. When they differ the save fails,
  naming the key and the ranks, unless the user allowed divergence (then the lowest
  rank's copy is written and a warning is returned).
- The distinct boxes of one key must not overlap and must cover the global shape.
- The non-tensor state trees of all ranks must be equal, except for per-rank nodes,
  whose per-rank entries are merged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ckptd.errors import DivergentReplicas, InvalidRequest
from ckptd.format import dtypes, hashing, values
from ckptd.format.manifest import MAX_DIMS, MAX_ELEMENTS, MAX_KEY_LEN


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    length: int
    blake3: str

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.chunk_offsets, self.chunk_sizes

    @classmethod
    def of_items(cls, items: Sequence[Any], digests: Sequence[Any]) -> list[ChunkPlan]:
        """The plan of a rank's writer items (ckptd.format.writer.WriteItem), hashed."""
        return [
            cls(
                it.key,
                it.dtype,
                tuple(it.shape),
                tuple(it.chunk_offsets),
                tuple(it.chunk_sizes),
                it.data.nbytes,
                hashing.chunk_digest(d),
            )
            for it, d in zip(items, digests, strict=True)
        ]


@dataclasses.dataclass
class Assignment:
    write: dict[int, list[int]]  # rank -> indices into that rank's plan
    warnings: list[str]
    bytes_by_rank: dict[int, int]
    # The holders (rank, index) of each replicated chunk: with `write`, what the ranks'
    # layouts alone decide (no warnings: every replica agreed), so a later save of the
    # same layouts reuses it and only compares the replicas' hashes (`assign(reuse=)`).
    replicas: list[tuple[tuple[int, int], ...]] | None = None


def check_chunk(c: ChunkPlan, where: str) -> None:
    """A chunk of a rank's plan as it came off the wire: the same limits a shard index
    is held to (ckptd.format.manifest), so a plan that could never be written and read
    back is refused at BeginSave, naming the field."""
    if not isinstance(c.key, str) or not c.key or len(c.key) > MAX_KEY_LEN or "\0" in c.key:
        raise InvalidRequest(
            f"{where}: chunk key {str(c.key)[:80]!r} must be 1..{MAX_KEY_LEN} characters without NUL"
        )
    what = f"{where} key {c.key[:200]!r}"
    try:
        itemsize = dtypes.itemsize(c.dtype)
    except KeyError:
        raise InvalidRequest(
            f"{what}: dtype {c.dtype[:40]!r} is not one ckptd stores ({', '.join(dtypes.SUPPORTED)})"
        ) from None
    ndim = len(c.shape)
    if ndim > MAX_DIMS or len(c.chunk_offsets) != ndim or len(c.chunk_sizes) != ndim:
        raise InvalidRequest(
            f"{what}: shape, chunk_offsets and chunk_sizes must have the same length "
            f"(at most {MAX_DIMS}), got {ndim}, {len(c.chunk_offsets)}, {len(c.chunk_sizes)}"
        )
    if any(x < 0 for x in (*c.shape, *c.chunk_offsets, *c.chunk_sizes, c.length)):
        raise InvalidRequest(f"{what}: dimensions, offsets and length must not be negative")
    for d, (n, o, s) in enumerate(zip(c.shape, c.chunk_offsets, c.chunk_sizes, strict=True)):
        if o + s > n:
            raise InvalidRequest(
                f"{what}: chunk {list(c.chunk_offsets)[:8]}+{list(c.chunk_sizes)[:8]} lies "
                f"outside shape {list(c.shape)[:8]} (dimension {d}; fields chunk_offsets, "
                "chunk_sizes)"
            )
    if math.prod(c.shape) > MAX_ELEMENTS:
        raise InvalidRequest(f"{what}: shape {list(c.shape)[:8]} has more than 2**62 elements")
    if c.length != math.prod(c.chunk_sizes) * itemsize:
        raise InvalidRequest(
            f"{what}: length {c.length} != {math.prod(c.chunk_sizes)} elements x {itemsize} "
            f"bytes of {c.dtype} (field length)"
        )
    if not hashing.is_hex_digest(c.blake3):
        raise InvalidRequest(
            f"{what}: the chunk's blake3 digest must be {hashing.HEX_LEN // 2} raw bytes, got "
            f"{len(c.blake3) // 2} (field digest)"
        )


def _overlap(a: ChunkPlan, b: ChunkPlan) -> bool:
    for oa, sa, ob, sb in zip(
        a.chunk_offsets, a.chunk_sizes, b.chunk_offsets, b.chunk_sizes, strict=True
    ):
        if oa + sa <= ob or ob + sb <= oa:
            return False
    return True


def assign(
    plans: Mapping[int, Sequence[ChunkPlan]],
    *,
    allow_divergent: bool = False,
    reuse: Assignment | None = None,
) -> Assignment:
    """Who writes which chunk. reuse: the assignment of a save whose ranks had the same
    layouts (ckptd.coordinator.layouts): its tiling and balance stand, and only the
    replicas' hashes are compared (unless some differ and that is allowed: then the
    lowest rank writes those, and everything is derived again)."""
    if reuse is not None and reuse.replicas is not None:
        diverged = [
            m
            for holders in reuse.replicas
            if (m := _differ([(r, plans[r][i]) for r, i in holders])) is not None
        ]
        if diverged and not allow_divergent:
            _refuse(diverged)
        if not diverged:
            return Assignment(reuse.write, [], reuse.bytes_by_rank, reuse.replicas)
    groups: dict[
        tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int, ChunkPlan]]
    ] = {}
    for rank in sorted(plans):
        for i, c in enumerate(plans[rank]):
            groups.setdefault((c.key, c.chunk_offsets, c.chunk_sizes), []).append((rank, i, c))
    warnings: list[str] = []
    diverged = []
    lowest_rank_writes: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    by_key: dict[str, list[ChunkPlan]] = {}
    for (key, _, _), holders in groups.items():
        first = holders[0][2]
        by_key.setdefault(key, []).append(first)
        if len(holders) == 1:  # not replicated (every chunk of one rank, most of FSDP's)
            continue
        if any(
            h[2].dtype != first.dtype or h[2].shape != first.shape or h[2].length != first.length
            for h in holders
        ):
            desc = ", ".join(f"rank {r}: {c.dtype}{list(c.shape)}" for r, _, c in holders[:8])
            raise DivergentReplicas(f"key {key!r}: ranks disagree on dtype or shape ({desc})")
        msg = _differ([(r, c) for r, _, c in holders])
        if msg is None:
            continue
        if allow_divergent:
            warnings.append(msg + "; writing the lowest rank's copy (allow_divergent_replicas)")
            lowest_rank_writes.add((key, first.chunk_offsets, first.chunk_sizes))
        else:
            diverged.append(msg)
    if diverged:
        _refuse(diverged)
    for key, chunks in by_key.items():
        _check_tiling(key, chunks)
    # Largest first, to the least-loaded holder: a greedy balance of write bytes.
    load = dict.fromkeys(plans, 0)
    write: dict[int, list[int]] = {r: [] for r in plans}
    for gkey, holders in sorted(groups.items(), key=lambda kv: (-kv[1][0][2].length, kv[0][0])):
        if gkey in lowest_rank_writes:
            rank, idx, c = holders[0]  # holders are in rank order
        else:
            rank, idx, c = min(holders, key=lambda h: (load[h[0]], h[0]))
        write[rank].append(idx)
        load[rank] += c.length
    for r in write:
        write[r].sort()
    replicas = [tuple((r, i) for r, i, _ in h) for h in groups.values() if len(h) > 1]
    return Assignment(write, warnings, load, None if warnings else replicas)


def _differ(holders: list[tuple[int, ChunkPlan]]) -> str | None:
    """Why the replicas of one chunk (rank, chunk) differ, or None when their hashes agree."""
    first = holders[0][1].blake3
    if all(c.blake3 == first for _, c in holders):
        return None
    by_hash: dict[str, list[int]] = {}
    for r, c in holders:
        by_hash.setdefault(c.blake3, []).append(r)
    groups_desc = "; ".join(
        f"ranks {rs[:8]}{'...' if len(rs) > 8 else ''} hold {h[:12]}" for h, rs in by_hash.items()
    )
    return f"key {holders[0][1].key!r}: replicas differ ({groups_desc})"


def _refuse(diverged: list[str]) -> NoReturn:
    more = f" (and {len(diverged) - 5} more keys)" if len(diverged) > 5 else ""
    raise DivergentReplicas(
        "ranks hold different values under the same key, so the save was refused: "
        + " | ".join(diverged[:5])
        + more
        + ". A plain tensor or value under one key on several ranks is a replica and must be "
        "equal everywhere; wrap values that are genuinely per rank in ckpt.PerRank(value)"
    )


def _check_tiling(key: str, chunks: list[ChunkPlan]) -> None:
    shape = chunks[0].shape
    total = 0
    for c in chunks:
        if c.shape != shape:
            raise DivergentReplicas(
                f"key {key!r}: ranks disagree on the global shape ({list(shape)} vs {list(c.shape)})"
            )
        if len(c.chunk_offsets) != len(shape) or any(
            o + s > n for o, s, n in zip(c.chunk_offsets, c.chunk_sizes, shape, strict=True)
        ):
            raise InvalidRequest(
                f"key {key!r}: chunk {list(c.chunk_offsets)}+{list(c.chunk_sizes)} lies outside shape {list(shape)}"
            )
        total += math.prod(c.chunk_sizes)
    if len(chunks) > 1 and shape:
        _check_disjoint(key, chunks)
    if total != math.prod(shape):
        raise InvalidRequest(
            f"key {key!r}: the ranks' chunks cover {total} of {math.prod(shape)} elements of "
            f"shape {list(shape)}; every element must be held by some rank"
        )


def _check_disjoint(key: str, chunks: list[ChunkPlan]) -> None:
    """No two distinct boxes overlap: a sweep along the dimension with the most distinct
    offsets, comparing a box only with the boxes still open at its start (linear for the
    usual splits, where that dimension is the sharded one)."""
    ndim = len(chunks[0].shape)
    d = max(range(ndim), key=lambda i: len({c.chunk_offsets[i] for c in chunks}))
    active: list[ChunkPlan] = []
    for c in sorted(chunks, key=lambda c: c.chunk_offsets[d]):
        start = c.chunk_offsets[d]
        active = [a for a in active if a.chunk_offsets[d] + a.chunk_sizes[d] > start]
        for a in active:
            if _overlap(a, c) and 0 not in a.chunk_sizes and 0 not in c.chunk_sizes:
                raise InvalidRequest(
                    f"key {key!r}: chunks {list(a.chunk_offsets)}+{list(a.chunk_sizes)} and "
                    f"{list(c.chunk_offsets)}+{list(c.chunk_sizes)} overlap but are not equal"
                )
        active.append(c)


# ----------------------------------------------------------------------------- state


def merge_states(
    states: Mapping[int, Any], rank_entries: Mapping[int, Sequence[Any]] | None = None
) -> Any:
    """One state tree from every rank's: equal everywhere except per-rank nodes.

    `rank_entries[r]`: rank r's per-rank entries sent apart from its tree
    (values.split_per_rank). When every rank's tree is one object (the servicer parses
    equal bytes once), the merge only fills its per-rank slots: linear in ranks x slots.
    Otherwise each rank's tree is rebuilt and all are merged in one walk (per-rank entries
    gathered, not re-merged pair by pair): linear in ranks x tree size. Identity, not
    `==`, decides: `==` holds 1 and true equal, which replicas must not be.
    """
    ranks = sorted(states)
    entries = rank_entries or {}
    first = states[ranks[0]]
    if all(states[r] is first for r in ranks):
        return values.join_per_rank(first, [entries.get(r) or () for r in ranks])
    trees = [(r, values.join_per_rank(states[r], [entries.get(r) or ()])) for r in ranks]
    return _merge_all(trees, "")


def _merge_all(nodes: list[tuple[int, Any]], path: str) -> Any:
    r0, first = nodes[0]
    if isinstance(first, dict) and len(first) == 1:
        ((tag, body),) = first.items()
        same_tag = all(isinstance(n, dict) and len(n) == 1 and tag in n for _, n in nodes)
        if same_tag and tag == "per_rank":
            merged: list[Any] = []
            seen: set[int] = set()
            for _, n in nodes:
                for pair in n["per_rank"]:
                    if int(pair[0]) not in seen:
                        seen.add(int(pair[0]))
                        merged.append(pair)
            return {"per_rank": merged}
        if (
            same_tag
            and tag in ("list", "tuple")
            and all(len(n[tag]) == len(body) for _, n in nodes)
        ):
            return {
                tag: [
                    _merge_all([(r, n[tag][i]) for r, n in nodes], f"{path}/{i}")
                    for i in range(len(body))
                ]
            }
        if same_tag and tag == "dict":
            keys = [k for k, _ in body]
            if all([k for k, _ in n["dict"]] == keys for _, n in nodes):
                return {
                    "dict": [
                        [
                            k,
                            _merge_all(
                                [(r, n["dict"][i][1]) for r, n in nodes], f"{path}/{_label(k)}"
                            ),
                        ]
                        for i, k in enumerate(keys)
                    ]
                }
        if same_tag and tag == "stateful":
            return {"stateful": _merge_all([(r, n["stateful"]) for r, n in nodes], path)}
    want = _canon(first)
    for r, n in nodes[1:]:
        got = _canon(n)
        if got != want:
            raise DivergentReplicas(
                f"state key {path or '<root>'!r}: rank {r0} and rank {r} hold different values "
                f"({want[:60]} vs {got[:60]}); non-tensor values are replicated and must be "
                "equal on every rank; wrap values that are genuinely per rank in ckpt.PerRank(value)"
            )
    return first


def _label(k: Any) -> str:
    return k if isinstance(k, str) else json.dumps(k)


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))
