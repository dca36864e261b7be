"""The coordinator sees nodes, not ranks (issue 15 part 1; docs/coordinator.md).

Real parts: a real grpc.aio coordinator on port 0, the real node aggregator, real rank
processes (gloo, 2 "nodes" x 2 ranks on this host, told apart by LOCAL_RANK /
LOCAL_WORLD_SIZE / GROUP_RANK) saving through the zero-config coordinator. A rank killed
mid-save aborts the save within the lease, its node's aggregator naming it; a killed
aggregator is a dead node; malformed batches and a rank claimed by two nodes are refused
with errors that name the node and the rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from coordinator_fixtures import ServerThread, read_catalog, spawn_ranks
from ranks import node_worker

from ckptd.coordinator.nodes import MAX_NODE_RANKS
from ckptd.errors import InvalidRequest
from ckptd.server.client import CoordinatorClient
from ckptd.server.node import NodeAggregator
from ckptd.v1 import coordinator_pb2 as pb

LEASE_S = 3.0


def begin_req(job: str, rank: int, world: int, step: int = 1) -> pb.BeginSaveRequest:
    ref = pb.SaveRef(job=job, step=step, generation=0, rank=rank, world_size=world)
    chunk = pb.Chunk(
        key=f"k{rank}", dtype="uint8", shape=[4], chunk_offsets=[0], chunk_sizes=[4], length=4
    )
    chunk.digest = bytes(32)
    return pb.BeginSaveRequest(ref=ref, chunks=[chunk], part=0, parts=1, timeout_ms=20_000)


@pytest.fixture
def server(tmp_path: Path):
    s = ServerThread(tmp_path / "root", lease_s=LEASE_S, barrier_timeout_s=20)
    client = CoordinatorClient(s.address)
    gen, job = client.open_job("job", "attempt-1")
    assert gen == 0
    yield s, client, job
    client.close()
    s.stop()


def test_malformed_node_batches_are_refused_naming_node_and_rank(server, tally) -> None:
    s, client, job = server
    with (
        tally.bad_input("node batch: empty"),
        pytest.raises(InvalidRequest, match="node 'n0'.*empty"),
    ):
        client.begin_save_node("n0", [])
    big = [begin_req(job, r, 2 * MAX_NODE_RANKS) for r in range(MAX_NODE_RANKS + 1)]
    with (
        tally.bad_input("node batch: oversized"),
        pytest.raises(
            InvalidRequest,
            match=rf"node 'n0'.*{MAX_NODE_RANKS + 1} ranks .*ranks 0\.\.{MAX_NODE_RANKS}",
        ),
    ):
        client.begin_save_node("n0", big)
    with (
        tally.bad_input("node batch: two saves"),
        pytest.raises(InvalidRequest, match="node 'n0'.*mixes saves: rank 1 names job .* step 2"),
    ):
        client.begin_save_node("n0", [begin_req(job, 0, 4), begin_req(job, 1, 4, step=2)])
    with (
        tally.bad_input("node batch: rank twice"),
        pytest.raises(InvalidRequest, match="node 'n0'.*rank 1 twice"),
    ):
        client.begin_save_node("n0", [begin_req(job, 1, 4), begin_req(job, 1, 4)])
    with (
        tally.bad_input("node batch: no node name"),
        pytest.raises(InvalidRequest, match="node name"),
    ):
        client.keep_alive_node("", [pb.KeepAliveRequest(ref=begin_req(job, 0, 4).ref)])


def test_a_rank_claimed_by_two_nodes_is_refused_and_aborts(server, tally) -> None:
    """Node a begins ranks 0 and 1; node b then sends rank 1 too: two processes claim to be
    rank 1, so the save is aborted and every rank learns which nodes clashed."""
    s, client, job = server
    import threading

    errors: list[Exception] = []

    def node_a() -> None:
        try:
            client.begin_save_node("host-a/node0", [begin_req(job, 0, 4), begin_req(job, 1, 4)])
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=node_a)
    t.start()
    time.sleep(0.5)  # node a's ranks wait at the barrier
    with (
        tally.bad_input("node batch: another node's rank"),
        pytest.raises(
            InvalidRequest, match="node 'host-b/node1' sent rank 1, which node 'host-a/node0'"
        ),
    ):
        client.begin_save_node("host-b/node1", [begin_req(job, 1, 4), begin_req(job, 2, 4)])
    t.join(10)
    assert errors and "host-b/node1" in str(errors[0]), errors
    st = client.keep_alive(pb_ref(job, 0, 4))
    assert st.status == "ABORTED" and "rank 1" in st.reason


def pb_ref(job: str, rank: int, world: int):  # the client's own type for its calls
    from ckptd.coordinator.types import SaveRef

    return SaveRef(job, 1, 0, rank, world)


def test_the_aggregator_refuses_a_rank_of_another_node(server, tally) -> None:
    s, client, job = server
    agg = NodeAggregator(client, "host-a/node0", [0, 1], token=None)
    rank_client = CoordinatorClient(agg.address, connect_retry_s=2)
    try:
        with (
            tally.bad_input("aggregator: rank of another node"),
            pytest.raises(
                InvalidRequest,
                match="rank 5 sent BeginSave to the aggregator of node 'host-a/node0'",
            ),
        ):
            rank_client.begin_save_pb(begin_req(job, 5, 8))
    finally:
        rank_client.close()
        agg.close()


# -- real rank processes ---------------------------------------------------------------
def run_nodes(tmp_path: Path, crash: str = "", timeout: float = 120) -> list[dict]:
    world, per_node = 4, 2
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "job"
    _, logs = spawn_ranks(
        node_worker.entry,
        world,
        lambda r, port: (r, world, per_node, port, str(job), str(out), crash),
        out,
        timeout=timeout,
    )
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "dead": True})
    return results, job, logs


@pytest.mark.multiprocess
def test_two_nodes_save_through_their_aggregators(tmp_path: Path) -> None:
    results, job, logs = run_nodes(tmp_path)
    assert all(r.get("step1") == "COMMITTED" for r in results), logs
    assert [r["via_aggregator"] for r in results] == [True] * 4, results
    assert [r["hosts_aggregator"] for r in results] == [True, False, True, False], results
    m = json.loads((job / "step-000000000001" / "MANIFEST.json").read_text())
    assert [s["rank"] for s in m["shards"]] == [0, 1, 2, 3]
    # Steps 2 and 3 repeat the layout: cached plans go through the aggregators and commit.
    assert all(r.get("steps_2_3") == "COMMITTED" and r["layout_known"] for r in results), logs
    assert (job / "step-000000000003" / "MANIFEST.json").exists()
    # Every node call went on the node session (ckptd.server.node_session), none by unary:
    # per save a begin, a report and an await a node at least.
    hosts = [r for r in results if r["hosts_aggregator"]]
    assert all(r["session_calls"] >= 9 and r["session_fell_back"] == 0 for r in hosts), hosts


@pytest.mark.multiprocess
def test_a_killed_rank_aborts_the_save_within_the_lease_naming_it(tmp_path: Path, tally) -> None:
    with tally.fault("node: rank killed mid-save"):
        results, job, logs = run_nodes(tmp_path, crash="rank.before_report@3")
        assert results[3].get("dead"), results
        for r in results[:3]:
            assert r["step1"] == "COMMITTED"
            assert "rank(s) 3" in r["step2"] and "node" in r["step2"], (r, logs)
            assert r["step2_s"] < 4 * LEASE_S + 10, r
        rows = read_catalog(job / ".ckptd" / "catalog.sqlite")
        assert rows[2]["status"] == "ABORTED" and "rank(s) 3 of node" in rows[2]["reason"]
        assert not (job / "step-000000000002" / "MANIFEST.json").exists()


@pytest.mark.multiprocess
def test_a_killed_aggregator_is_a_dead_node(tmp_path: Path, tally) -> None:
    """Rank 2 hosts node 1's aggregator: killing it silences node 1 (ranks 2 and 3)."""
    with tally.fault("node: aggregator killed mid-save"):
        results, job, logs = run_nodes(tmp_path, crash="rank.before_report@2")
        assert results[2].get("dead"), results
        for r in (results[0], results[1], results[3]):
            assert r["step1"] == "COMMITTED"
            assert r["step2"] != "COMMITTED", (r, logs)
            assert r["step2_s"] < 4 * LEASE_S + 15, r
        rows = read_catalog(job / ".ckptd" / "catalog.sqlite")
        assert rows[2]["status"] == "ABORTED", rows[2]
        reason = rows[2]["reason"]
        assert "rank(s) 2" in reason and "node1" in reason, reason
        assert not (job / "step-000000000002" / "MANIFEST.json").exists()


def test_an_error_through_the_aggregator_names_the_save_once(server, tally) -> None:
    """The coordinator's error reaches the rank through the aggregator's client and the
    rank's own: it says "job ... step ... rank" once, not once per hop."""
    s, client, job = server
    agg = NodeAggregator(client, "host-a/node0", [0], token=None)
    rank_client = CoordinatorClient(agg.address, connect_retry_s=2)
    bad = begin_req(job, 0, 2)
    bad.chunks[0].dtype = "no-such-dtype"
    try:
        with tally.bad_input("aggregator: error passed through"):
            with pytest.raises(InvalidRequest) as err:
                rank_client.begin_save_pb(bad)
        msg = str(err.value)
        assert msg.count(f"job {job!r}") == 1 and msg.count(" step 1") == 1, msg
        assert "rank 0" in msg and "no-such-dtype" in msg, msg
    finally:
        rank_client.close()
        agg.close()
