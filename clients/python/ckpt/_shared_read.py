"""Read once, verify, send: a load at N ranks reads each stored byte from storage once.

Every rank plans its own load (ckpt._restore: which hash blocks of which saved entries its
boxes need) and the ranks exchange those needs over the job's process group. From the same
inputs every rank computes the same assignment: the needed blocks are cut into pieces
(consecutive blocks of one entry that the same ranks need, at most a read window each) and
each piece gets one reader, balanced by bytes (ties go to a node that reads less, then to
a rank that needs the piece itself, so it sends one copy fewer). Then, window by window
(two windows of half of `shared_window` bytes in flight per rank: the next is read
while this one is sent), the readers read their pieces from
storage and verify every block (ckptd.format.reader), the ranks agree that every read
succeeded, and each piece goes from its reader to the ranks that need it: one broadcast
when every rank needs it (replicated state), point-to-point sends otherwise. A receiver
checks the blocks it got against the index's blake3 (`verify_received`, on by default: it
costs one hash of the received bytes, on the receiver's threads) before copying them into
its tensors.

Failures are the job's, alike on every rank: a reader that finds a corrupt block raises
its HashMismatch; every other rank raises PeerReadFailed naming the reader and what it
found, at the same collective, so the load policy (ckpt._load) falls back or fails on all
ranks together. A corrupt transfer is not the storage's fault: it fails the load without
marking the step.

Everything on the wire between ranks is plain bytes: JSON for the plan, raw tensor bytes
for the data; nothing is pickled. The collectives run on gloo with CPU tensors, or NCCL
with tensors on the rank's CUDA device (the bytes are staged through it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckpt._world import collective_device
from ckptd import knobs
from ckptd.errors import CkptError, CorruptCheckpoint, PeerReadFailed
from ckptd.format import hashing
from ckptd.format.boxes import BoxPlan, borrowed_context
from ckptd.format.checkpoint import OpenCheckpoint
from ckptd.format.manifest import IndexEntry
from ckptd.format.reader import EntryRead, covering_blocks, read_entries

_READY, _SKIP, _FAILED = "ready", "skip", "failed"
_MAX_PLAN_BYTES = 1 << 30  # a rank's announced needs; far above any real plan


class Peers:
    """The ranks of the default process group, and the few collectives a shared read uses."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.nccl = dist.get_backend() == "nccl"
        self.device = collective_device()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.per_node = local if local > 0 else self.world

    @classmethod
    def current(cls) -> Peers | None:
        """The job's process group, when it has more than one rank and shared reads are on."""
        if not knobs.get().shared_read:
            return None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls()

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def all_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's payload, in rank order (two all_gathers: sizes, then padded bytes)."""
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        lengths = [int(s.item()) for s in sizes]
        top = max(lengths)
        if top > _MAX_PLAN_BYTES:
            raise CkptError(f"a rank announced a load plan of {top} bytes, over the limit")
        mine = torch.zeros(max(top, 1), dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.device)
        outs = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(outs, mine)
        return [o[:k].cpu().numpy().tobytes() for o, k in zip(outs, lengths, strict=True)]


@dataclasses.dataclass(frozen=True)
class Announce:
    """What one rank says before a shared read of one copy of a step."""

    status: str  # ready: planned, and will read with the others; skip / failed: will not
    copy: str = ""  # identity of the copy: the step and every index's blake3
    tiers: int = 0  # how many copies this rank's load tries (the same on every rank)
    needs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 4), np.int64))

    def encode(self) -> bytes:
        head = json.dumps({"status": self.status, "copy": self.copy, "tiers": self.tiers}).encode()
        return len(head).to_bytes(4, "little") + head + self.needs.astype("<i8").tobytes()

    @classmethod
    def decode(cls, data: bytes) -> Announce:
        n = int.from_bytes(data[:4], "little")
        head = json.loads(data[4 : 4 + n])
        needs = np.frombuffer(data[4 + n :], dtype="<i8").reshape(-1, 4)
        return cls(str(head["status"]), str(head["copy"]), int(head["tiers"]), needs)


def copy_identity(ck: OpenCheckpoint) -> str:
    """Ranks read together only from the same committed bytes: the step and its indexes."""
    return hashing.digest(
        json.dumps([ck.step, [s.index_blake3 for s in ck.manifest.shards]]).encode()
    )


def needs_of(plan: BoxPlan, block: int) -> np.ndarray:
    """(shard, entry offset, first block, number of blocks) runs this rank's plan reads."""
    rows: list[tuple[int, int, int, int]] = []
    for sr in plan.shards:
        for r in sr.reads:
            blocks = covering_blocks(r.entry.length, block, r.ranges)
            start = prev = -2
            for b in blocks:
                if b != prev + 1:
                    if start >= 0:
                        rows.append((sr.shard, r.entry.offset, start, prev - start + 1))
                    start = b
                prev = b
            if start >= 0:
                rows.append((sr.shard, r.entry.offset, start, prev - start + 1))
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def announce(peers: Peers, mine: Announce) -> list[Announce]:
    """Every rank's announcement (a collective every rank makes once per copy tried).

    Ranks that try different numbers of copies (a mirror configured on some ranks only)
    would make different numbers of collectives and hang: every rank refuses at once.
    """
    said = [Announce.decode(b) for b in peers.all_gather_bytes(mine.encode())]
    counts = {a.tiers for a in said}
    if len(counts) > 1:
        raise CkptError(
            f"rank {peers.rank}: the ranks of this load try different numbers of copies "
            f"({', '.join(f'rank {r}: {a.tiers}' for r, a in enumerate(said))}); configure "
            "the same tiers (mirror or none) on every rank, or load with read='each'"
        )
    return said


def all_ready(peers: Peers, said: Sequence[Announce]) -> bool:
    """A shared read happens only when every rank planned the same copy."""
    return all(a.status == _READY for a in said) and len({a.copy for a in said}) == 1


@dataclasses.dataclass
class Piece:
    """Consecutive blocks of one saved entry that the same ranks need; one reader reads it."""

    shard: int
    entry: IndexEntry
    first: int  # first block
    count: int
    nbytes: int
    needers: tuple[int, ...]
    start: int  # byte offset of the first block inside the entry
    reader: int = -1


def make_pieces(
    ck: OpenCheckpoint, said: Sequence[Announce], block: int, limit: int
) -> list[Piece]:
    """The needed blocks of every rank, cut into pieces, in storage order.

    Works on the announced runs, not on single blocks: per entry, a sweep over the runs'
    ends gives the stretches that one set of ranks needs (one stretch of all ranks for a
    replicated entry, however many ranks), each cut at `limit` bytes.
    """
    entries: dict[tuple[int, int], IndexEntry] = {}
    for f, e in ck.stored():  # by file: a borrowed entry's bytes are in another step's
        entries[(f, e.offset)] = e
    runs: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r, a in enumerate(said):
        for shard, off, first, count in a.needs.tolist():
            ent = entries.get((shard, off))
            n_blocks = -(-ent.length // block) if ent is not None else 0
            if ent is None or count < 1 or first < 0 or first + count > n_blocks:
                raise CkptError(
                    f"{_where(ck)}: rank {r} asked for blocks {first}..{first + count} of an "
                    f"entry at byte {off} of shard {shard}, which has no such blocks"
                )
            runs.setdefault((shard, off), []).append((first, first + count, r))
    per_piece = max(1, limit // block)
    pieces: list[Piece] = []
    for (shard, off), spans in sorted(runs.items()):
        e = entries[(shard, off)]
        events: dict[int, list[tuple[int, int]]] = {}
        for lo, hi, r in spans:
            events.setdefault(lo, []).append((r, 1))
            events.setdefault(hi, []).append((r, -1))
        active: dict[int, int] = {}  # rank -> how many of its runs cover this stretch
        cuts = sorted(events)
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            for r, d in events[lo]:
                active[r] = active.get(r, 0) + d
                if not active[r]:
                    del active[r]
            if not active:
                continue
            who = tuple(sorted(active))
            for b in range(lo, hi, per_piece):
                count = min(per_piece, hi - b)
                nbytes = min(e.length, (b + count) * block) - b * block
                pieces.append(Piece(shard, e, b, count, nbytes, who, b * block))
    return pieces


def assign_readers(pieces: Sequence[Piece], peers: Peers) -> None:
    """One reader per piece, the same on every rank: least bytes, then least-loaded node,
    then a rank that needs the piece (no send to itself); largest pieces first."""
    load = [0] * peers.world
    node_load: dict[int, int] = {}
    for p in sorted(pieces, key=lambda p: (-p.nbytes, p.shard, p.entry.offset, p.first)):
        needs = set(p.needers)
        best = min(
            range(peers.world),
            key=lambda r: (load[r], node_load.get(peers.node(r), 0), r not in needs, r),
        )
        p.reader = best
        load[best] += p.nbytes
        node_load[peers.node(best)] = node_load.get(peers.node(best), 0) + p.nbytes


def windows(pieces: Sequence[Piece], limit: int) -> list[list[Piece]]:
    """Consecutive pieces holding at most `limit` bytes (one piece may be all of one)."""
    out: list[list[Piece]] = []
    cur: list[Piece] = []
    acc = 0
    for p in pieces:
        if cur and acc + p.nbytes > limit:
            out.append(cur)
            cur, acc = [], 0
        cur.append(p)
        acc += p.nbytes
    if cur:
        out.append(cur)
    return out


@dataclasses.dataclass
class SharedReadStats:
    read_bytes: int = 0  # read from storage by this rank (whole blocks, verified)
    received_bytes: int = 0  # got from other ranks (verified again when verify_received)
    sent_bytes: int = 0
    # Per shard file this rank took bytes from, the ranks that read them; the files this
    # rank read (for anyone). Where each came from: LoadResult.shard_tiers.
    readers: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    read_paths: set[str] = dataclasses.field(default_factory=set)


def read_shared(
    ck: OpenCheckpoint,
    plan: BoxPlan,
    peers: Peers,
    said: Sequence[Announce],
    *,
    threads: int | None = None,
) -> SharedReadStats:
    """This rank's part of a shared read (a collective of the ranks that announced `said`).

    Every rank calls it with the same announcements; it returns when this rank's boxes are
    filled, or raises on every rank alike.
    """
    k = knobs.get()
    block = ck.manifest.block_size
    pieces = make_pieces(ck, said, block, max(block, k.read_window))
    assign_readers(pieces, peers)
    sinks = _local_sinks(plan)
    stats = SharedReadStats()
    bad_transfer: str | None = None
    # Two windows in flight: the next one is read (a thread of its own; the reads inside
    # run on the I/O pool) while this one is sent, checked and copied.
    wins = windows(pieces, max(block, k.shared_window // 2))
    ahead = ThreadPoolExecutor(1, thread_name_prefix="ckpt-shared-read")

    def start(win: list[Piece]) -> tuple[list[Piece], dict[int, np.ndarray], Future[Any]]:
        bufs = {id(p): np.empty(p.nbytes, dtype=np.uint8) for p in win if _holds(p, peers.rank)}
        return win, bufs, ahead.submit(_read_mine, ck, win, bufs, peers.rank, threads)

    nxt = start(wins[0]) if wins else None
    try:
        for i in range(len(wins)):
            assert nxt is not None
            win, bufs, reading = nxt
            error = reading.result()
            nxt = start(wins[i + 1]) if i + 1 < len(wins) else None
            stats.read_bytes += sum(p.nbytes for p in win if p.reader == peers.rank)
            if peers.all_max(1 if error is not None else 0):
                _raise_agreed(peers, error, ck)
            _transfer(win, bufs, peers, stats)
            for p in win:
                if p.reader == peers.rank:
                    stats.read_paths.add(ck.files[p.shard])
                if peers.rank not in p.needers:
                    continue
                stats.readers.setdefault(ck.files[p.shard], set()).add(p.reader)
                data = bufs[id(p)]
                if p.reader != peers.rank and k.verify_received and bad_transfer is None:
                    bad_transfer = _check_received(ck, p, data, block)
                if bad_transfer is None:
                    _apply(sinks, p, data)
            del bufs
    finally:
        ahead.shutdown(wait=True)  # a read ahead of a failure ends before its buffers go
    if peers.all_max(1 if bad_transfer is not None else 0):
        raise CkptError(
            bad_transfer
            or f"{_where(ck)}: another rank received bytes that do not match the index (see "
            "its log); the load is abandoned on every rank. The stored copy is not at fault"
        )
    return stats


def _holds(p: Piece, rank: int) -> bool:
    return p.reader == rank or rank in p.needers


def _where(ck: OpenCheckpoint) -> str:
    return f"{ck.storage.url} step {ck.step}"


def _read_mine(
    ck: OpenCheckpoint,
    win: Sequence[Piece],
    bufs: dict[int, np.ndarray],
    rank: int,
    threads: int | None,
) -> CorruptCheckpoint | None:
    """Read and verify this rank's pieces of the window into their buffers."""
    block = ck.manifest.block_size
    by_shard: dict[int, list[Piece]] = {}
    for p in win:
        if p.reader == rank:
            by_shard.setdefault(p.shard, []).append(p)
    try:
        for shard, mine in by_shard.items():
            reads = [
                EntryRead(p.entry, [(p.start, min(p.entry.length, (p.first + p.count) * block))])
                for p in mine
            ]

            def sink(i: int, start: int, data: np.ndarray, mine: list[Piece] = mine) -> None:
                p = mine[i]
                at = start - p.start
                bufs[id(p)][at : at + data.nbytes] = data

            read_entries(
                ck.storage,
                ck.files[shard],
                reads,
                block,
                sink=sink,
                threads=threads,
            )
    except CorruptCheckpoint as e:
        return borrowed_context(ck, shard, e)
    return None


def _raise_agreed(peers: Peers, error: CorruptCheckpoint | None, ck: OpenCheckpoint) -> None:
    """Every rank learns what the failed readers found, then raises (a collective)."""
    told = peers.all_gather_bytes(b"" if error is None else str(error).encode())
    if error is not None:
        raise error
    who = [(r, m.decode(errors="replace")) for r, m in enumerate(told) if m]
    r, msg = who[0]
    raise PeerReadFailed(
        f"{_where(ck)}: another rank (rank {r}), reading this copy for the whole job, "
        f"found: {msg}; every rank abandons this copy"
    )


def _transfer(
    win: Sequence[Piece], bufs: dict[int, np.ndarray], peers: Peers, stats: SharedReadStats
) -> None:
    """Each piece from its reader to the ranks that need it: broadcasts, then sends."""
    me = peers.rank
    work: list[tuple[dist.Work | None, torch.Tensor, np.ndarray | None]] = []

    def tensor_of(p: Piece, receiving: bool) -> tuple[torch.Tensor, np.ndarray | None]:
        host = torch.from_numpy(bufs[id(p)])
        if not peers.nccl:
            return host, None
        dev = torch.empty(p.nbytes, dtype=torch.uint8, device=peers.device)
        if not receiving:
            dev.copy_(host)
        return dev, bufs[id(p)] if receiving else None

    everyone = tuple(range(peers.world))
    for p in win:
        if p.needers != everyone:
            continue
        t, back = tensor_of(p, receiving=me != p.reader)
        work.append((dist.broadcast(t, src=p.reader, async_op=True), t, back))
        if me == p.reader:
            stats.sent_bytes += p.nbytes * (peers.world - 1)
        else:
            stats.received_bytes += p.nbytes
    for tag, p in enumerate(win):
        if p.needers == everyone:
            continue
        if me == p.reader:
            t, _ = tensor_of(p, receiving=False)
            for dst in p.needers:
                if dst != me:
                    work.append((dist.isend(t, dst=dst, tag=tag), t, None))
                    stats.sent_bytes += p.nbytes
        elif me in p.needers:
            t, back = tensor_of(p, receiving=True)
            work.append((dist.irecv(t, src=p.reader, tag=tag), t, back))
            stats.received_bytes += p.nbytes
    for w, t, back in work:
        if w is not None:
            w.wait()
        if back is not None:
            back[:] = t.cpu().numpy()


def _check_received(ck: OpenCheckpoint, p: Piece, data: np.ndarray, block: int) -> str | None:
    for i in range(p.count):
        b = p.first + i
        lo = i * block
        got = hashing.digest(data[lo : lo + min(block, p.entry.length - b * block)])
        if got != p.entry.blake3[b]:
            return (
                f"{_where(ck)}: key {p.entry.key!r} block {p.entry.first_block + b} received "
                f"from rank {p.reader} has "
                f"blake3 {got[:16]}..., the index says {p.entry.blake3[b][:16]}...: the "
                "transfer between ranks is corrupt (the stored copy verified on the reader); "
                "check the network or set CKPT_SHARED_READ=0 to read on every rank"
            )
    return None


Sinks = dict[tuple[int, int], list[Callable[[int, np.ndarray], object]]]


def _local_sinks(plan: BoxPlan) -> Sinks:
    """Where this rank's bytes of each (shard, entry offset) go."""
    out: Sinks = {}
    for sr in plan.shards:
        for r, sink in zip(sr.reads, sr.sinks, strict=True):
            out.setdefault((sr.shard, r.entry.offset), []).append(sink)
    return out


def _apply(sinks: Sinks, p: Piece, data: np.ndarray) -> None:
    """Copy a piece into this rank's boxes (each sink takes the part its box overlaps)."""
    for fn in sinks.get((p.shard, p.entry.offset), []):
        fn(p.start, data)
