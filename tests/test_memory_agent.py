"""The memory agent over its real wire (a server thread on port 0, real files): the
token, path confinement, the hashes checked on arrival, the budget (ckptd.agent)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from ckpt import _provenance
from ckptd.agent.client import AgentClient, AgentStorage, HeldStorage
from ckptd.agent.holdings import Budget, Holdings
from ckptd.agent.server import AgentServer
from ckptd.errors import (
    CkptError,
    HashMismatch,
    InvalidRequest,
    MemoryBudgetExceeded,
    Unauthenticated,
    UnsafePath,
)
from ckptd.format import layout
from ckptd.format.writer import ShardWriter, WriteItem, hash_items, plan_offsets

TOKEN = "s3cret"


@pytest.fixture
def clients():
    made: list[AgentClient] = []

    def make(address: str, token: str = TOKEN) -> AgentClient:
        made.append(AgentClient(address, token))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def agents(tmp_path: Path, clients):
    started = []

    def start(node: int, **budget) -> AgentServer:
        srv = AgentServer(
            Holdings(str(tmp_path / f"node{node}"), Budget(**budget), node=node), TOKEN
        )
        srv.client = clients(srv.address)  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def write_shard(srv: AgentServer, step: int, rank: int, nbytes: int) -> dict:
    """A rank of the agent's node writes a shard in place (as ckpt._memory does)."""
    data = (np.arange(nbytes, dtype=np.uint64) * (rank + 7) % 251).astype(np.uint8)
    items = [WriteItem(f"t{rank}", "uint8", [nbytes], [0], [nbytes], data)]
    offsets, size = plan_offsets([nbytes], 4096)
    digests = hash_items(items)
    client = srv.client  # type: ignore[attr-defined]
    names = [layout.shard_name(rank), layout.index_name(rank)]
    client.call("prepare", "t", step=step, files=names, size=size)
    w = ShardWriter(
        srv.holdings.storage, job="j", step=step, rank=rank, world_size=2, generation=0, size=size
    )
    w.write(items, offsets, digests=digests)
    info = w.finish(items, offsets, digests, verify="size")
    return info.to_json()


def test_a_wrong_or_missing_token_is_refused(agents, clients, tally):
    srv = agents(0)
    for token in ("wrong", ""):
        with tally.bad_input("memory-agent:token"):
            with pytest.raises(Unauthenticated, match="token"):
                clients(srv.address, token).call("ping", "t")
    assert srv.client.call("ping", "t")[0]["node"] == 0


def test_paths_are_confined_and_only_quarantine_markers_written(agents, tally):
    srv = agents(0)
    st = AgentStorage(srv.client, node=0)
    for path in ("../etc/passwd", "/etc/passwd", "step-000000000001/../../x"):
        with tally.bad_input("memory-agent:path"):
            with pytest.raises((UnsafePath, InvalidRequest)):
                st.exists(path)
    with tally.bad_input("memory-agent:write"):
        with pytest.raises(InvalidRequest, match="QUARANTINED.json"):
            st.write_atomic("agent.json", b"{}")


def test_a_shard_is_verified_then_copied_to_the_peer_and_verified_there(agents):
    a, b = agents(0), agents(1)
    shard = write_shard(a, 3, 0, 10_000)
    reply, _ = a.client.call("seal", "t", step=3, shard=shard, replicas=[b.address])
    assert [h["node"] for h in reply["held"]] == [0, 1] and reply["failures"] == []
    # Each holder's agent says which index digest it computed: the coordinator commits on it.
    assert {h["index_blake3"] for h in reply["held"]} == {shard["index_blake3"]}
    peer = AgentStorage(b.client, node=1)
    sdir = layout.step_dir(3)
    assert peer.size(f"{sdir}/{shard['path']}") == shard["size"]
    local = a.holdings.storage.read_bytes(f"{sdir}/{shard['path']}", limit=1 << 20)
    assert peer.open_read(f"{sdir}/{shard['path']}").read(0, shard["size"]).tobytes() == local


def test_a_flipped_bit_is_caught_on_arrival(agents, tally):
    # A block the rank wrote wrong into its node's memory (after hashing it): its own agent
    # does not hash it again (ckptd.agent.holdings.seal), the peer does, on arrival, and
    # refuses the copy, so the shard is held on one node and the step cannot commit.
    a, b = agents(0), agents(1)
    shard = write_shard(a, 3, 0, 10_000)
    path = Path(a.holdings.root) / layout.step_dir(3) / shard["path"]
    raw = bytearray(path.read_bytes())
    raw[5] ^= 1
    path.write_bytes(bytes(raw))
    with tally.fault("memory-agent:bitflip-on-arrival"):
        reply, _ = a.client.call("seal", "t", step=3, shard=shard, replicas=[b.address])
        assert [h["node"] for h in reply["held"]] == [0]
        assert len(reply["failures"]) == 1
        assert "do not match the hashes computed at save" in reply["failures"][0]
        peer = Path(b.holdings.root) / layout.step_dir(3) / shard["path"]
        assert not peer.exists()  # a refused copy is not held


def test_seal_refuses_an_index_other_than_the_one_the_rank_reported(agents, tally):
    a = agents(0)
    shard = write_shard(a, 3, 0, 10_000)
    with tally.fault("memory-agent:index-digest"):
        with pytest.raises(HashMismatch, match="does not hash to the digest the rank reported"):
            a.client.call("seal", "t", step=3, shard={**shard, "index_blake3": "0" * 64})
        assert not (Path(a.holdings.root) / layout.step_dir(3) / shard["path"]).exists()


def test_a_shard_over_the_budget_is_refused_naming_it(agents, tally):
    a = agents(0, max_bytes=64 << 10)
    client = a.client
    with tally.bad_input("memory-agent:over-budget"):
        with pytest.raises(MemoryBudgetExceeded, match="max_bytes=65536"):
            client.call("prepare", "t", step=1, files=["shards/rank-00000.bin"], size=1 << 20)


def test_eviction_keeps_the_newest_committed_step(agents):
    a = agents(0, max_steps=2)
    client = a.client
    for step in (1, 2, 3):
        shard = write_shard(a, step, 0, 5000)
        client.call("seal", "t", step=step, shard=shard, replicas=[])
        (Path(a.holdings.root) / layout.step_dir(step) / layout.MANIFEST_NAME).write_text("{}")
    usage = client.call("usage", "t")[0]["usage"]
    assert usage["steps"] == [2, 3]
    # A step that cannot make room (the newest committed and the one being written stay).
    a.holdings.budget = Budget(max_steps=2, max_bytes=12_000)
    with pytest.raises(MemoryBudgetExceeded, match="newest committed"):
        client.call("prepare", "t", step=4, files=["shards/rank-00000.bin"], size=9000)


def test_unknown_ops_and_bad_shards_are_refused(agents, tally):
    a = agents(0)
    client = a.client
    with tally.bad_input("memory-agent:op"):
        with pytest.raises(InvalidRequest, match="unknown op"):
            client.call("unpickle", "t")
    with tally.bad_input("memory-agent:shard"):
        with pytest.raises(CkptError):
            client.call("seal", "t", step=1, shard={"rank": 0, "path": "../x"}, replicas=[])


def test_a_held_load_names_the_node_each_file_came_from(agents):
    # Node 0 holds rank 0's shard, node 1 rank 1's: a load on node 0 reads rank 1's from
    # node 1's agent, and says so per file (LoadResult.shard_tiers, ckpt._provenance).
    a, b = agents(0), agents(1)
    mine, theirs = write_shard(a, 3, 0, 10_000), write_shard(b, 3, 1, 10_000)
    for srv, shard in ((a, mine), (b, theirs)):
        srv.client.call("seal", "t", step=3, shard=shard, replicas=[])
    sdir = layout.step_dir(3)
    files = [f"{sdir}/{mine['path']}", f"{sdir}/{theirs['path']}"]
    held = HeldStorage(
        [a.holdings.storage, AgentStorage(b.client, node=1)], nodes=[0, 1], home=0, listed=1
    )
    for f in files:
        held.open_read(f).read(0, 100)
    assert _provenance.alone("memory", held, files) == {
        files[0]: "memory",
        files[1]: "peer:node1",
    }
    # On node 1 (its peer tier lists node 0 first) the same files are named from there.
    there = HeldStorage(
        [b.holdings.storage, AgentStorage(a.client, node=0)], nodes=[1, 0], home=1, listed=1
    )
    assert _provenance.alone("memory", there, files) == {
        files[0]: "peer:node0",
        files[1]: "memory",
    }
    # A shared read: another rank read a file (its place travels as "node:<N>").
    places = [{files[1]: _provenance.place("memory", held, files[1])}, {files[1]: "node:1"}]
    assert _provenance.together(held, {files[1]: {0, 1}}, places) == {files[1]: "peer:node1"}
    assert _provenance.together(there, {files[1]: {0}}, places) == {files[1]: "memory"}
    # Storage's tiers are named as such.
    assert _provenance.alone("local", a.holdings.storage, files[:1]) == {files[0]: "local"}
