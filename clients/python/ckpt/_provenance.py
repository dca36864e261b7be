"""Where each shard file of a load came from: LoadResult.shard_tiers.

A load reads one copy of a step (LoadResult.tier names its tier), but a memory tier's copy
is spread over the ring: HeldStorage (ckptd.agent.client) reads each file from the nearest
node holding it, and a shared read (ckpt._shared_read) gets a file's bytes from whichever
rank the plan made its reader, read from that rank's nearest holder. So the record is per
shard file this rank's tensors took bytes from (its path in the job's layout, an earlier
step's when borrowed): the tier name ("local", "mirror"), or for a memory tier "memory"
(this rank's node) or "peer:node<N>"; a file whose bytes came from several places (a
shared read's pieces) joins their names with "+", sorted.

A place travels between ranks in an absolute form ("node:<N>", or the tier name) and is
named relative to the receiving rank only there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ckpt._restore import PreparedStep
from ckptd.agent.client import HeldStorage
from ckptd.storage.base import Storage

_NODE = "node:"


def place(tier: str, st: Storage, path: str) -> str:
    """Where this rank read `path` of `tier` from, in a form any rank can name."""
    if isinstance(st, HeldStorage):
        return f"{_NODE}{st.origin(path)}"
    return tier


def name(st: Storage, where: str) -> str:
    """`where` (a place() of any rank) as this rank says it."""
    if where.startswith(_NODE) and isinstance(st, HeldStorage):
        return st.label(int(where[len(_NODE) :]))
    return where


def files_of(prepared: object) -> list[str]:
    """The shard files a prepared step's plan reads (none for an integration's loader)."""
    if isinstance(prepared, PreparedStep):
        return [s.path for s in prepared.planner.box_plan().shards]
    return []


def alone(tier: str, st: Storage, files: Iterable[str]) -> dict[str, str]:
    """This rank read every file itself."""
    return {f: name(st, place(tier, st, f)) for f in files}


def together(
    st: Storage,
    readers: Mapping[str, Iterable[int]],
    places: list[Mapping[str, str]],
) -> dict[str, str]:
    """A shared read: `readers` are the ranks that read each file's bytes this rank took,
    `places[r]` where rank r read each file it read (every rank's, gathered)."""
    out = {}
    for f, ranks in readers.items():
        out[f] = "+".join(sorted({name(st, places[r].get(f, "?")) for r in ranks}))
    return out
