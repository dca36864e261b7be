"""The catalog's report rows grow with nodes, not ranks: a node's batch of reports is one
row, read back whole by a restarted coordinator (real core, real SQLite, real shards)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import torch
from coordinator_fixtures import RankSim, catalog_report_rows, new_core, run, started

import ckpt
from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.types import ShardReport


def test_a_node_batch_of_reports_is_one_catalog_row(tmp_path: Path) -> None:
    root = tmp_path / "root"
    job = str(root / "job")
    cat = root / ".ckptd" / "catalog.sqlite"
    world, per_node = 8, 4

    async def main() -> None:
        core = new_core(root)
        async with started(core):
            ranks = [RankSim(core, job, r, world) for r in range(world)]
            for r in ranks:
                r.prepare({"w": ckpt.PerRank(torch.full((16,), float(r.rank)))})
            nodes = [ranks[i : i + per_node] for i in range(0, world, per_node)]
            begun = await asyncio.gather(
                *(
                    core.begin_save_node(
                        f"node{n}", [(r.ref(1), r.plan, {"state": r.node}) for r in node]
                    )
                    for n, node in enumerate(nodes)
                )
            )
            for node, answers in zip(nodes, begun, strict=True):
                for r, b in zip(node, answers, strict=True):
                    r.begun = b
            written = await asyncio.gather(*(r.write(1) for r in ranks))
            reports = dict(zip((r.rank for r in ranks), written, strict=True))
            await core.report_shards_node("node0", [(r.ref(1), reports[r.rank]) for r in nodes[0]])
            # One row for node 0's four reports; node 1 has not reported.
            assert catalog_report_rows(cat, 1) == [per_node]
            got = core.catalog.reports(core.job_name(job), 1, 0)
            assert sorted(got) == [0, 1, 2, 3]
            assert all(isinstance(v, ShardReport) for v in got.values())
            assert got[2] == reports[2]
            await core.report_shards_node("node1", [(r.ref(1), reports[r.rank]) for r in nodes[1]])
            st = await core.await_commit(ranks[0].ref(1), 30)
            assert st.status == "COMMITTED", st
            assert catalog_report_rows(cat, 1) == []  # a committed save's rows are gone

    run(main())


def test_per_rank_rows_of_an_older_catalog_are_still_read(tmp_path: Path) -> None:
    """A save in flight across an upgrade: its reports are rows of the per-rank table."""
    path = tmp_path / "catalog.sqlite"
    cat = Catalog(str(path))
    rep = ShardReport(
        "shards/rank-00001.bin", 4096, "shards/rank-00001.json", 200, "ab" * 32, "full"
    )
    db = sqlite3.connect(path)
    db.execute(
        "INSERT INTO reports (job, step, generation, rank, report) VALUES (?, ?, ?, ?, ?)",
        (
            "/j",
            3,
            0,
            1,
            '{"shard_path": "shards/rank-00001.bin", "size": 4096, '
            '"index_path": "shards/rank-00001.json", "index_size": 200, '
            f'"index_blake3": "{"ab" * 32}", "verify": "full"}}',
        ),
    )
    db.commit()
    db.close()
    assert cat.reports("/j", 3, 0) == {1: rep}
    cat.close()
