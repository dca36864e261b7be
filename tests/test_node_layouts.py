"""Cached plans through node batches: a batch whose ranks' layouts the coordinator does
not all hold (evicted, or a restarted coordinator) is told so at once, whole, and its ranks
resend whole plans; nothing waits out the barrier. Real grpc.aio servers on port 0, the
real node aggregator, the real client, real shard files."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_fixtures import ServerThread

from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.errors import LayoutUnknown
from ckptd.format import hashing
from ckptd.format.writer import WriteItem, write_shard
from ckptd.server import converters as cv
from ckptd.server.client import CoordinatorClient
from ckptd.server.node import NodeAggregator
from ckptd.storage import open_storage
from ckptd.v1 import coordinator_pb2 as pb

WORLD = 4
PER_NODE = 2


def items(rank: int, step: int) -> list[WriteItem]:
    data = np.full(64, (rank * 7 + step) % 256, dtype=np.uint8)
    return [WriteItem(f"w/@rank{rank}", "uint8", [64], [0], [64], data)]


def plan_of(rank: int, step: int) -> tuple[list[WriteItem], list[list[str]], list[ChunkPlan]]:
    its = items(rank, step)
    digests = [[hashing.digest(it.data)] for it in its]
    return its, digests, ChunkPlan.of_items(its, digests)


def save_rank(client: CoordinatorClient, job: str, job_path: str, rank: int, step: int) -> str:
    """One rank's whole save through `client` (its node's aggregator): the final status."""
    its, digests, plan = plan_of(rank, step)
    ref = SaveRef(job, step, 0, rank, WORLD)
    begun = client.begin_save(
        ref,
        plan,
        state={"per_rank": [[rank, {"tensor": f"w/@rank{rank}"}]]},
        metadata={},
        allow_divergent=False,
        keep_last=0,
        timeout_s=30,
    )
    info = write_shard(
        open_storage(job_path),
        job=job_path,
        step=step,
        rank=rank,
        world_size=WORLD,
        generation=0,
        items=[its[i] for i in begun.write],
        verify="size",
        digests=[digests[i] for i in begun.write],
    )
    client.report_shard(ref, ShardReport.of(info, "size"))
    return client.await_commit(ref, 60).status


def save_all(clients: list[CoordinatorClient], job: str, job_path: str, step: int) -> list[Any]:
    out: list[Any] = [None] * WORLD

    def one(r: int) -> None:
        try:
            out[r] = save_rank(clients[r], job, job_path, r, step)
        except Exception as e:  # the test asserts on it
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


class Nodes:
    """Two nodes of two ranks, each behind a real NodeAggregator, over one coordinator."""

    def __init__(self, address: str):
        self.upstream = CoordinatorClient(address, connect_retry_s=20)
        _, self.job = self.upstream.open_job("job", "attempt-1")
        self.aggs = [
            NodeAggregator(
                self.upstream, f"node{n}", range(n * PER_NODE, (n + 1) * PER_NODE), token=None
            )
            for n in range(WORLD // PER_NODE)
        ]
        self.clients = [
            CoordinatorClient(self.aggs[r // PER_NODE].address, connect_retry_s=20)
            for r in range(WORLD)
        ]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for a in self.aggs:
            a.close()
        self.upstream.close()


def test_a_restarted_coordinator_gets_whole_plans_through_the_aggregators(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s = ServerThread(root, lease_s=10.0, barrier_timeout_s=30)
    nodes = Nodes(s.address)
    job_path = str(root / "job")
    try:
        assert save_all(nodes.clients, nodes.job, job_path, 1) == ["COMMITTED"] * WORLD
        assert save_all(nodes.clients, nodes.job, job_path, 2) == ["COMMITTED"] * WORLD
        held = [c.layouts for c in nodes.clients]
        assert all(h for h in held), "the ranks hold their layouts: the next plans are cached"
        port = s.port
        s.stop()
        s = ServerThread(root, lease_s=10.0, barrier_timeout_s=30, port=port)
        assert not s.core.layouts._held, "a restarted coordinator holds no layouts"
        t0 = time.monotonic()
        assert save_all(nodes.clients, nodes.job, job_path, 3) == ["COMMITTED"] * WORLD
        assert time.monotonic() - t0 < 25, "a barrier was waited out"
        # The whole plans were accepted again: step 4 goes cached and commits.
        assert s.core.layouts._held
        assert save_all(nodes.clients, nodes.job, job_path, 4) == ["COMMITTED"] * WORLD
    finally:
        nodes.close()
        s.stop()


def test_a_batch_with_an_evicted_layout_is_told_at_once_and_whole(tmp_path: Path, tally) -> None:
    """Rank 1's layout was evicted, rank 0's is held: the batch is refused before either
    rank joins the save (a rank joined and waiting would hold the batch's answer, and so
    its sibling's resend, until the barrier timed out)."""
    root = tmp_path / "root"
    s = ServerThread(root, lease_s=10.0, barrier_timeout_s=30)
    nodes = Nodes(s.address)
    job_path = str(root / "job")
    try:
        assert save_all(nodes.clients, nodes.job, job_path, 1) == ["COMMITTED"] * WORLD
        s.call(_evict(s, nodes.job, 1))
        reqs = []
        for r in (0, 1):
            _, _, plan = plan_of(r, 2)
            reqs.append(
                pb.BeginSaveRequest(
                    ref=cv.ref_to_pb(SaveRef(nodes.job, 2, 0, r, WORLD)),
                    layout_digest=nodes.clients[r].layouts[(nodes.job, r)],
                    digests=b"".join(bytes.fromhex(c.blake3) for c in plan),
                    part=0,
                    parts=1,
                    timeout_ms=30_000,
                )
            )
        t0 = time.monotonic()
        with (
            tally.fault("node batch: a rank's cached layout evicted"),
            pytest.raises(LayoutUnknown, match=r"node 'node0'.*rank\(s\) 1\b"),
        ):
            nodes.upstream.begin_save_node("node0", reqs)
        assert time.monotonic() - t0 < 10
        session = s.core.sessions.get((nodes.job, 2))
        assert session is None or not session.plans, "no rank of the batch joined"
        # The ranks resend whole plans (the client does this on LayoutUnknown): it commits.
        assert save_all(nodes.clients, nodes.job, job_path, 2) == ["COMMITTED"] * WORLD
    finally:
        nodes.close()
        s.stop()


async def _evict(s: ServerThread, job: str, rank: int) -> None:
    s.core.layouts._held.pop((job, rank))
