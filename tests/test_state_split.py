"""A save's state trees travel apart from their per-rank entries (values.split_per_rank):
every rank sends equal tree bytes, the coordinator parses, checks and merges them once, and
the merged tree is the one the whole-tree merge gives. Real grpc.aio server, real client."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from coordinator_fixtures import ServerThread

from ckptd.coordinator.planning import ChunkPlan, merge_states
from ckptd.coordinator.types import SaveRef
from ckptd.errors import CkptError, DivergentReplicas, InvalidRequest
from ckptd.format import values
from ckptd.server import converters as cv
from ckptd.server.client import CoordinatorClient
from ckptd.v1 import coordinator_pb2 as pb


def rank_tree(rank: int, *, step: Any = 7) -> dict[str, Any]:
    """A tree as ckpt's flatten makes it: replicated values, per-rank nodes at several
    depths (in a dict, a list and a Stateful), a tensor reference."""
    return {
        "dict": [
            ["model", {"dict": [["w", {"tensor": "model/w"}]]}],
            ["rng", {"per_rank": [[rank, {"tensor": f"rng/@rank{rank}"}]]}],
            [
                "loader",
                {"stateful": {"list": [{"per_rank": [[rank, rank * 10]]}, "epoch-1"]}},
            ],
            ["step", step],
        ]
    }


def test_a_subtree_without_per_rank_nodes_is_shared_not_copied() -> None:
    """Splitting and joining rebuild only the path to a per-rank node: a state without one
    comes back as the same object (a copy was a list a dict entry alive through every
    save), and the round trip gives the tree it started from."""
    plain = {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}]]}], ["step", 7]]}
    shared, slots = values.split_per_rank(plain)
    assert shared is plain and slots == []
    assert values.join_per_rank(shared, [[]]) is plain
    tree = rank_tree(3)
    shared, slots = values.split_per_rank(tree)
    model = tree["dict"][0][1]
    assert shared["dict"][0][1] is model  # the model's subtree has no per-rank node
    assert shared["dict"][1][1] == {"per_rank": []} and len(slots) == 2
    assert values.join_per_rank(shared, [slots]) == tree


def test_split_then_join_gives_the_tree_back() -> None:
    tree = rank_tree(3)
    shared, mine = values.split_per_rank(tree)
    assert values.count_per_rank(shared) == 2 == len(mine)
    assert shared == values.split_per_rank(rank_tree(5))[0]  # equal on every rank
    assert values.join_per_rank(shared, [mine]) == tree


def test_merging_split_trees_equals_merging_whole_trees() -> None:
    ranks = range(6)
    whole = merge_states({r: rank_tree(r) for r in ranks})
    parts = {r: values.split_per_rank(rank_tree(r)) for r in ranks}
    one = parts[0][0]  # the object every rank's equal bytes parse to
    split = merge_states({r: one for r in ranks}, {r: parts[r][1] for r in ranks})
    assert split == whole
    # Trees that are equal but distinct objects take the whole-tree walk: same answer.
    again = merge_states({r: parts[r][0] for r in ranks}, {r: parts[r][1] for r in ranks})
    assert again == whole


def test_replicas_that_differ_are_still_refused_one_and_true_included() -> None:
    parts = {r: values.split_per_rank(rank_tree(r, step=1 if r != 2 else True)) for r in range(4)}
    with pytest.raises(DivergentReplicas, match=r"state key '/step': rank 0 and rank 2"):
        merge_states({r: p[0] for r, p in parts.items()}, {r: p[1] for r, p in parts.items()})


def chunk(rank: int) -> ChunkPlan:
    return ChunkPlan(f"k{rank}", "uint8", (4,), (0,), (4,), 4, "00" * 32)


@pytest.fixture
def server(tmp_path: Path):
    s = ServerThread(tmp_path / "root", lease_s=5.0, barrier_timeout_s=20)
    client = CoordinatorClient(s.address)
    _, job = client.open_job("job", "attempt-1")
    yield s, client, job
    client.close()
    s.stop()


def begin_all(client: CoordinatorClient, job: str, trees: list[Any]) -> list[Any]:
    """Every rank's BeginSave, as ckpt sends it, in threads (they meet at the barrier)."""
    world = len(trees)
    out: list[Any] = [None] * world

    def one(r: int) -> None:
        try:
            out[r] = client.begin_save(
                SaveRef(job, 1, 0, r, world),
                [chunk(r)],
                state=trees[r],
                metadata={"run": "split"},
                allow_divergent=False,
                keep_last=0,
                timeout_s=20,
            )
        except CkptError as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_the_coordinator_parses_a_saves_tree_once_and_merges_it_whole(server) -> None:
    s, client, job = server
    world = 8
    answers = begin_all(client, job, [rank_tree(r) for r in range(world)])
    assert all(not isinstance(a, Exception) for a in answers), answers
    session = s.core.sessions[(job, 1)]
    trees = {id(p.state) for p in session.plans.values()}
    assert len(trees) == 1, "every rank's equal tree bytes should parse to one object"
    assert session.state == merge_states({r: rank_tree(r) for r in range(world)})


def test_a_client_sending_whole_trees_still_merges(server) -> None:
    """A tree with its per-rank entries inside (no rank_state) is merged as before."""
    s, client, job = server
    world = 3
    reqs = []
    for r in range(world):
        req = pb.BeginSaveRequest(
            ref=cv.ref_to_pb(SaveRef(job, 1, 0, r, world)),
            chunks=[cv.chunk_to_pb(chunk(r))],
            part=0,
            parts=1,
            state=json.dumps(rank_tree(r)).encode(),
            timeout_ms=20_000,
        )
        reqs.append(req)
    out: list[Any] = [None] * world
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, client.begin_save_pb(reqs[r])))
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(a is not None and a.complete for a in out), out
    assert s.core.sessions[(job, 1)].state == merge_states({r: rank_tree(r) for r in range(world)})


@pytest.mark.parametrize(
    "rank_state, why",
    [
        (b"[[]]", "1 per-rank entries for a state with 2 per-rank node"),
        (b'[[[1, {"tensor": "x"}]], [["one", 2]]]', "per_rank items must be"),
        (b'{"a": 1}', "dict per-rank entries"),
    ],
)
def test_bad_per_rank_entries_are_refused_naming_the_rank(server, tally, rank_state, why) -> None:
    s, client, job = server
    shared, _ = cv.state_fields(rank_tree(1))
    req = pb.BeginSaveRequest(
        ref=cv.ref_to_pb(SaveRef(job, 1, 0, 1, 2)),
        chunks=[cv.chunk_to_pb(chunk(1))],
        part=0,
        parts=1,
        state=shared,
        rank_state=rank_state,
        timeout_ms=20_000,
    )
    with (
        tally.bad_input(f"BeginSave rank_state: {why}"),
        pytest.raises(
            CkptError, match=rf"job .job. step 1 rank 1.* rank_state(\[\d+\])?: .*{re.escape(why)}"
        ),
    ):
        client.begin_save_pb(req)
    # The save is aborted for every rank, which learns why at once.
    with pytest.raises(CkptError, match="aborted"):
        client.begin_save_pb(
            pb.BeginSaveRequest(
                ref=cv.ref_to_pb(SaveRef(job, 1, 0, 0, 2)),
                chunks=[cv.chunk_to_pb(chunk(0))],
                part=0,
                parts=1,
                state=shared,
                timeout_ms=20_000,
            )
        )


def test_rank_state_that_is_not_json_is_refused(server, tally) -> None:
    s, client, job = server
    req = pb.BeginSaveRequest(
        ref=cv.ref_to_pb(SaveRef(job, 1, 0, 0, 1)),
        chunks=[cv.chunk_to_pb(chunk(0))],
        part=0,
        parts=1,
        state=b'{"per_rank": []}',
        rank_state=b"[[[0, NaN]]]",
        timeout_ms=20_000,
    )
    with (
        tally.bad_input("BeginSave rank_state: not JSON"),
        pytest.raises(InvalidRequest, match="rank_state is not valid JSON"),
    ):
        client.begin_save_pb(req)


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"NaN", b"Infinity"])
def test_a_state_with_a_non_finite_number_is_refused(server, tally, number) -> None:
    """1e999 parses to inf without any constant: the manifest could never be written."""
    s, client, job = server
    req = pb.BeginSaveRequest(
        ref=cv.ref_to_pb(SaveRef(job, 1, 0, 0, 1)),
        chunks=[cv.chunk_to_pb(chunk(0))],
        part=0,
        parts=1,
        state=b'{"list": [1, ' + number + b"]}",
        timeout_ms=20_000,
    )
    with (
        tally.bad_input(f"BeginSave state: {number.decode()}"),
        pytest.raises(InvalidRequest, match="state is not valid JSON .*no NaN or Infinity"),
    ):
        client.begin_save_pb(req)
