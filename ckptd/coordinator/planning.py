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
from typing import Any

from ckptd.errors import DivergentReplicas, InvalidRequest


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


@dataclasses.dataclass
class Assignment:
    write: dict[int, list[int]]  # rank -> indices into that rank's plan
    warnings: list[str]
    bytes_by_rank: dict[int, int]


def _overlap(a: ChunkPlan, b: ChunkPlan) -> bool:
    for oa, sa, ob, sb in zip(
        a.chunk_offsets, a.chunk_sizes, b.chunk_offsets, b.chunk_sizes, strict=True
    ):
        if oa + sa <= ob or ob + sb <= oa:
            return False
    return True


def assign(
    plans: Mapping[int, Sequence[ChunkPlan]], *, allow_divergent: bool = False
) -> Assignment:
    groups: dict[
        tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int, ChunkPlan]]
    ] = {}
    for rank in sorted(plans):
        for i, c in enumerate(plans[rank]):
            groups.setdefault((c.key, c.chunk_offsets, c.chunk_sizes), []).append((rank, i, c))
    warnings: list[str] = []
    diverged: list[str] = []
    lowest_rank_writes: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    by_key: dict[str, list[ChunkPlan]] = {}
    for (key, _, _), holders in groups.items():
        first = holders[0][2]
        by_key.setdefault(key, []).append(first)
        if any(
            h[2].dtype != first.dtype or h[2].shape != first.shape or h[2].length != first.length
            for h in holders
        ):
            desc = ", ".join(f"rank {r}: {c.dtype}{list(c.shape)}" for r, _, c in holders[:8])
            raise DivergentReplicas(f"key {key!r}: ranks disagree on dtype or shape ({desc})")
        hashes = {h[2].blake3 for h in holders}
        if len(hashes) > 1:
            by_hash: dict[str, list[int]] = {}
            for r, _, c in holders:
                by_hash.setdefault(c.blake3, []).append(r)
            groups_desc = "; ".join(
                f"ranks {rs[:8]}{'...' if len(rs) > 8 else ''} hold {h[:12]}"
                for h, rs in by_hash.items()
            )
            msg = f"key {key!r}: replicas differ ({groups_desc})"
            if allow_divergent:
                warnings.append(msg + "; writing the lowest rank's copy (allow_divergent_replicas)")
                lowest_rank_writes.add((key, first.chunk_offsets, first.chunk_sizes))
            else:
                diverged.append(msg)
    if diverged:
        more = f" (and {len(diverged) - 5} more keys)" if len(diverged) > 5 else ""
        raise DivergentReplicas(
            "ranks hold different values under the same key, so the save was refused: "
            + " | ".join(diverged[:5])
            + more
            + ". A plain tensor or value under one key on several ranks is a replica and must be "
            "equal everywhere; wrap values that are genuinely per rank in ckpt.PerRank(value)"
        )
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
    return Assignment(write, warnings, load)


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
    if len(chunks) > 1:
        ordered = sorted(chunks, key=lambda c: c.chunk_offsets)
        # Quadratic only in the number of distinct chunks of one key (ranks holding parts).
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                if _overlap(a, b):
                    raise InvalidRequest(
                        f"key {key!r}: chunks {list(a.chunk_offsets)}+{list(a.chunk_sizes)} and "
                        f"{list(b.chunk_offsets)}+{list(b.chunk_sizes)} overlap but are not equal"
                    )
    if total != math.prod(shape):
        raise InvalidRequest(
            f"key {key!r}: the ranks' chunks cover {total} of {math.prod(shape)} elements of "
            f"shape {list(shape)}; every element must be held by some rank"
        )


# ----------------------------------------------------------------------------- state


def merge_states(states: Mapping[int, Any]) -> Any:
    """One state tree from every rank's: equal everywhere except per-rank nodes."""
    ranks = sorted(states)
    merged = states[ranks[0]]
    for r in ranks[1:]:
        merged = _merge(merged, states[r], "", ranks[0], r)
    return merged


def _merge(a: Any, b: Any, path: str, ra: int, rb: int) -> Any:
    if isinstance(a, dict) and isinstance(b, dict) and len(a) == 1 and len(b) == 1:
        ((ta, ba),) = a.items()
        ((tb, bb),) = b.items()
        if ta == tb == "per_rank":
            seen = {int(x[0]) for x in ba}
            return {"per_rank": [*ba, *(x for x in bb if int(x[0]) not in seen)]}
        if ta == tb and ta in ("list", "tuple") and len(ba) == len(bb):
            return {
                ta: [
                    _merge(x, y, f"{path}/{i}", ra, rb)
                    for i, (x, y) in enumerate(zip(ba, bb, strict=True))
                ]
            }
        if ta == tb == "dict" and [k for k, _ in ba] == [k for k, _ in bb]:
            return {
                "dict": [
                    [k, _merge(x, y, f"{path}/{_label(k)}", ra, rb)]
                    for (k, x), (_, y) in zip(ba, bb, strict=True)
                ]
            }
        if ta == tb == "stateful":
            return {"stateful": _merge(ba, bb, path, ra, rb)}
    if _canon(a) == _canon(b):
        return a
    raise DivergentReplicas(
        f"state key {path or '<root>'!r}: rank {ra} and rank {rb} hold different values "
        f"({_canon(a)[:60]} vs {_canon(b)[:60]}); non-tensor values are replicated and must be "
        "equal on every rank; wrap values that are genuinely per rank in ckpt.PerRank(value)"
    )


def _label(k: Any) -> str:
    return k if isinstance(k, str) else json.dumps(k)


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))
