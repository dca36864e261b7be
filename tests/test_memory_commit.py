"""The coordinator commits memory checkpoints (ckptd.coordinator.memory), over real gRPC.

Ranks' MemorySave calls against a real coordinator and catalog: the step is committed only
when every shard is held on two distinct nodes whose agents computed the rank's index
digest; the catalog records the memory tier; an older generation is fenced, a silent rank
aborts the save within the lease, and a restarted coordinator aborts what was open and
keeps what it committed.
"""

from __future__ import annotations

import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator_fixtures import ServerThread

from ckpt._flatten import flatten
from ckptd.coordinator.types import SaveRef
from ckptd.errors import InvalidRequest, StaleGeneration, UnsafePath
from ckptd.format import layout
from ckptd.format.manifest import parse_manifest
from ckptd.server.client import CoordinatorClient

WORLD, PER_NODE = 4, 2


def digest_of(rank: int) -> str:
    return f"{rank:02d}" * 32


def report(rank: int, held: dict[int, str] | None = None, **kw: Any) -> dict[str, Any]:
    """Rank `rank`'s "held" report: its shard on its own node and the ring's next one."""
    node = rank // PER_NODE
    nodes = WORLD // PER_NODE
    if held is None:
        held = {node: digest_of(rank), (node + 1) % nodes: digest_of(rank)}
    state, _ = flatten({"w": torch.zeros(4), "step": 6}, rank=rank)
    doc = {
        "shard": {
            "rank": rank,
            "path": f"shards/{layout.shard_name(rank, 0).split('/')[-1]}",
            "size": 4096,
            "index": f"shards/{layout.index_name(rank, 0).split('/')[-1]}",
            "index_size": 512,
            "index_blake3": digest_of(rank),
        },
        "held": [{"node": n, "index_blake3": d} for n, d in held.items()],
        "node": node,
        "nodes": nodes,
        "copies": 2,
        "block_size": 1 << 20,
        "alignment": 4096,
        "state": state,
        "metadata": {"lr": 0.1} if rank == 0 else {},
        "parent": 5,
        "url": "agent://node0/dev/shm/x",
    }
    doc.update(kw)
    return doc


@pytest.fixture
def server(tmp_path: Path):
    s = ServerThread(tmp_path, lease_s=2.0)
    yield s
    s.stop()


def client_of(s: ServerThread) -> CoordinatorClient:
    return CoordinatorClient(s.address, connect_retry_s=20)


def refs(job: str, step: int, generation: int = 0) -> list[SaveRef]:
    return [SaveRef(job, step, generation, r, WORLD) for r in range(WORLD)]


def memory_rows(root: Path) -> dict[int, tuple[str, str]]:
    with sqlite3.connect(root / ".ckptd" / "catalog.sqlite") as db:
        rows = db.execute("SELECT step, status, reason FROM tiers WHERE tier='memory'").fetchall()
    return {step: (status, reason) for step, status, reason in rows}


def save(c: CoordinatorClient, job: str, step: int, reports: list[dict], gen: int = 0) -> list:
    """Every rank joins, then reports; returns each rank's final (status, manifest)."""
    rs = refs(job, step, gen)
    for ref in rs:
        assert c.memory_save(ref, "join", timeout_s=30)[0].status == "OPEN"

    def one(r: int) -> Any:
        st, m = c.memory_save(rs[r], "held", reports[r])
        while st.status == "OPEN":
            st, m = c.memory_save(rs[r], "await", timeout_s=5)
        return st, m

    with ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(one, range(WORLD)))


def test_committed_when_every_shard_is_on_two_nodes_with_agreeing_digests(server, tmp_path):
    c = client_of(server)
    job = str(tmp_path / "job")
    assert c.open_job(job, "a")[0] == 0
    out = save(c, job, 6, [report(r) for r in range(WORLD)])
    assert [st.status for st, _ in out] == ["COMMITTED"] * WORLD
    manifests = {m for _, m in out}
    assert len(manifests) == 1  # one manifest, built by the coordinator
    m = parse_manifest(manifests.pop(), what="test")
    assert [s.rank for s in m.shards] == list(range(WORLD))
    assert [s.index_blake3 for s in m.shards] == [digest_of(r) for r in range(WORLD)]
    assert m.step == 6 and m.parent == 5 and m.metadata == {"lr": 0.1}
    assert {st.manifest_blake3 for st, _ in out} != {""}
    status, reason = memory_rows(tmp_path)[6]
    assert status == "HELD" and "nodes [0, 1]" in reason, reason
    # Nothing of a memory step reaches storage, nor the saves table.
    assert not (tmp_path / "job" / layout.step_dir(6)).exists()
    assert c.list_checkpoints(job) == []
    # A retry of a decided save gets the same answer.
    st, again = c.memory_save(refs(job, 6)[3], "await", timeout_s=1)
    assert st.status == "COMMITTED" and again == out[3][1]


@pytest.mark.parametrize(
    ("case", "held", "why"),
    [
        ("one-copy", {0: digest_of(1)}, "rank 1: held on nodes [0], 2 needed"),
        ("bad-digest", {0: digest_of(1), 1: "ff" * 32}, "digests of nodes [1] disagree"),
        ("not-own-node", {1: digest_of(1)}, "its own node 0 does not hold it"),
    ],
)
def test_a_shard_on_too_few_nodes_or_with_a_disagreeing_digest_is_not_committed(
    server, tmp_path, tally, case, held, why
):
    c = client_of(server)
    job = str(tmp_path / "job")
    c.open_job(job, "a")
    reports = [report(r) for r in range(WORLD)]
    reports[1] = report(1, held=held)
    with tally.fault(f"memory-commit:{case}"):
        out = save(c, job, 8, reports)
    assert [st.status for st, _ in out] == ["ABORTED"] * WORLD
    assert all(why in st.reason for st, _ in out), out[0][0].reason
    assert {m for _, m in out} == {b""}
    status, reason = memory_rows(tmp_path)[8]
    assert status == "FAILED" and why in reason


def test_a_malformed_report_is_refused(server, tmp_path, tally):
    c = client_of(server)
    job = str(tmp_path / "job")
    c.open_job(job, "a")
    ref = refs(job, 2)[0]
    c.memory_save(ref, "join", timeout_s=30)
    bad = report(0)
    bad["shard"]["path"] = "../../etc/passwd"
    with tally.bad_input("memory-commit:bad-path"), pytest.raises(UnsafePath):
        c.memory_save(ref, "held", bad)
    with (
        tally.bad_input("memory-commit:bad-holder"),
        pytest.raises(InvalidRequest, match="holders"),
    ):
        c.memory_save(ref, "held", report(0, held={7: digest_of(0)}))
    with tally.bad_input("memory-commit:bad-phase"), pytest.raises(InvalidRequest, match="phase"):
        c.memory_save(ref, "commit")


def test_an_older_generation_is_fenced_and_a_newer_one_aborts_its_memory_save(server, tmp_path):
    c = client_of(server)
    job = str(tmp_path / "job")
    assert c.open_job(job, "first")[0] == 0
    old = refs(job, 4, 0)
    for ref in old:
        c.memory_save(ref, "join", timeout_s=30)
    assert c.open_job(job, "second")[0] == 1  # the job restarted
    with pytest.raises(StaleGeneration):
        c.memory_save(old[0], "held", report(0))
    status, reason = memory_rows(tmp_path)[4]
    assert status == "FAILED" and "superseded by generation 1" in reason


def test_a_rank_that_dies_mid_save_aborts_it_within_the_lease(server, tmp_path, tally):
    c = client_of(server)
    job = str(tmp_path / "job")
    c.open_job(job, "a")
    rs = refs(job, 6)
    for ref in rs:
        c.memory_save(ref, "join", timeout_s=30)
    with tally.fault("memory-commit:rank-died"):
        # Ranks 0-2 report; rank 3 joined and then went silent (its process died).
        for r in range(3):
            st, _ = c.memory_save(rs[r], "held", report(r))
        while st.status == "OPEN":  # bounded by the lease (2 s): the watchdog ends it
            st, _ = c.memory_save(rs[0], "await", timeout_s=5)
    assert st.status == "ABORTED" and "rank 3 went silent" in st.reason, st.reason
    assert memory_rows(tmp_path)[6][0] == "FAILED"


def test_a_restarted_coordinator_aborts_what_was_open_and_keeps_what_it_committed(tmp_path):
    first = ServerThread(tmp_path, lease_s=2.0)
    c = client_of(first)
    job = str(tmp_path / "job")
    c.open_job(job, "a")
    assert {st.status for st, _ in save(c, job, 2, [report(r) for r in range(WORLD)])} == {
        "COMMITTED"
    }
    rs = refs(job, 4)
    for ref in rs:
        c.memory_save(ref, "join", timeout_s=30)
    port = first.port
    first.stop()
    second = ServerThread(tmp_path, lease_s=2.0, port=port)
    try:
        st, manifest = c.memory_save(rs[0], "held", report(0))
        assert st.status == "ABORTED" and "does not know this memory save" in st.reason
        assert manifest == b""
        assert memory_rows(tmp_path)[2][0] == "HELD"
        assert 4 not in memory_rows(tmp_path)
    finally:
        c.close()
        second.stop()


def test_a_report_that_is_not_an_object_is_refused(server, tmp_path, tally):
    c = client_of(server)
    job = str(tmp_path / "job")
    c.open_job(job, "a")
    ref = refs(job, 3)[0]
    c.memory_save(ref, "join", timeout_s=30)
    with tally.bad_input("memory-commit:not-an-object"):
        with pytest.raises(InvalidRequest, match="memory report"):
            c.memory_save(ref, "held", json.loads("[1]"))
