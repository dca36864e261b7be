"""The plan of a shared read (ckpt._shared_read), without processes: pieces and readers.

Every rank computes the plan alone from the same announcements, so it must be a pure
function of them: each needed block in exactly one piece, with exactly the ranks that
announced it, pieces at most the read limit; readers balanced by bytes, spread over nodes,
and a rank that needs a piece preferred at equal load. Bad announcements are refused
with the rank and the entry named.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from ckpt import _shared_read as sr
from ckptd.errors import CkptError
from ckptd.format.manifest import IndexEntry

BLOCK = 4


def entry(offset: int, length: int) -> IndexEntry:
    return IndexEntry("k", "uint8", [length], [0], [length], offset, length, [])


def checkpoint(entries: list[IndexEntry]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        indexes=[types.SimpleNamespace(entries=entries)],
        stored=lambda: ((0, e) for e in entries),  # one file: the one shard
        storage=types.SimpleNamespace(url="memory://job"),
        step=7,
    )


def peers(world: int, per_node: int) -> sr.Peers:
    p = object.__new__(sr.Peers)
    p.rank, p.world, p.per_node, p.nccl = 0, world, per_node, False
    return p


def announce(rows: list[tuple[int, int, int, int]]) -> sr.Announce:
    return sr.Announce("ready", "copy", 1, np.array(rows, dtype=np.int64).reshape(-1, 4))


def test_pieces_hold_each_needed_block_once_with_exactly_its_ranks() -> None:
    for trial in range(300):  # random announcements, checked against a map of every block
        rnd = random.Random(trial)
        ents = [entry(i * 4096, rnd.randint(1, 40)) for i in range(3)]
        world = rnd.randint(1, 6)
        said, want = [], {}
        for r in range(world):
            rows = []
            for e in ents:
                n = -(-e.length // BLOCK)
                for _ in range(rnd.randint(0, 2)):
                    a = rnd.randrange(n)
                    c = rnd.randint(1, n - a)
                    rows.append((0, e.offset, a, c))
                    for b in range(a, a + c):
                        want.setdefault((e.offset, b), set()).add(r)
            said.append(announce(rows))
        pieces = sr.make_pieces(checkpoint(ents), said, BLOCK, 3 * BLOCK)
        got: dict[tuple[int, int], set[int]] = {}
        for p in pieces:
            assert 1 <= p.count <= 3, trial
            assert p.nbytes == min(p.entry.length, (p.first + p.count) * BLOCK) - p.start, trial
            assert p.start == p.first * BLOCK, trial
            for b in range(p.first, p.first + p.count):
                assert (p.entry.offset, b) not in got, trial
                got[(p.entry.offset, b)] = set(p.needers)
        assert got == want, trial


def test_a_replicated_entry_is_one_stretch_of_every_rank_however_many_ranks() -> None:
    e = entry(0, 64 * BLOCK)
    said = [announce([(0, 0, 0, 64)]) for _ in range(4096)]
    pieces = sr.make_pieces(checkpoint([e]), said, BLOCK, 16 * BLOCK)
    assert [p.count for p in pieces] == [16] * 4
    assert all(p.needers == tuple(range(4096)) for p in pieces)


def test_readers_are_balanced_by_bytes_and_spread_over_nodes() -> None:
    ents = [entry(i * 4096, 8 * BLOCK) for i in range(16)]
    said = [announce([(0, e.offset, 0, 8) for e in ents]) for _ in range(8)]
    pieces = sr.make_pieces(checkpoint(ents), said, BLOCK, 8 * BLOCK)
    sr.assign_readers(pieces, peers(8, per_node=4))
    load = [sum(p.nbytes for p in pieces if p.reader == r) for r in range(8)]
    assert load == [2 * 8 * BLOCK] * 8
    # The largest pieces go to different nodes in turn.
    first_two = sorted(pieces, key=lambda p: (-p.nbytes, p.entry.offset))[:2]
    assert {first_two[0].reader // 4, first_two[1].reader // 4} == {0, 1}


def test_a_piece_goes_to_a_rank_that_needs_it_when_loads_are_equal() -> None:
    e = entry(0, 4 * BLOCK)
    said = [announce([]), announce([]), announce([(0, 0, 0, 4)])]
    pieces = sr.make_pieces(checkpoint([e]), said, BLOCK, 4 * BLOCK)
    sr.assign_readers(pieces, peers(3, per_node=3))
    assert [p.reader for p in pieces] == [2]


@pytest.mark.parametrize(
    "row", [(0, 4096, 0, 1), (0, 0, 3, 5), (0, 0, -1, 1), (0, 0, 0, 0), (1, 0, 0, 1)]
)
def test_an_announcement_outside_the_checkpoint_is_refused(row, tally) -> None:
    e = entry(0, 4 * BLOCK)
    with tally.bad_input("a shared-read announcement outside the checkpoint"):
        with pytest.raises(CkptError, match=r"rank 1 asked for blocks .* of shard"):
            sr.make_pieces(checkpoint([e]), [announce([]), announce([row])], BLOCK, BLOCK)
