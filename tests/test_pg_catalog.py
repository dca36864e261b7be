# ruff: noqa: F811 - pytest fixtures imported from pg_server are used as parameters
"""The catalog's semantics, one suite run on both backends: SQLite (the embedded default)
and PostgreSQL (a real server, tests/pg_server.py); then what only PostgreSQL has: the
root it belongs to, the leadership lock, and fencing of a leader that lost it.

Every conformance test gets `open_catalog`, which opens (and reopens) the catalog of its
backend, and runs the Catalog's own methods: the statements are written once
(catalog.Catalog), so equal answers here mean one set of semantics.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator_fixtures import RankSim, run
from pg_server import leading_backend, pg_server, pg_url  # noqa: F401

from ckptd.coordinator.catalog import Catalog, CatalogError, CatalogUnavailable, SaveRecord
from ckptd.coordinator.catalog_sql import Sql
from ckptd.coordinator.core import Coordinator
from ckptd.coordinator.types import ShardReport

OpenCatalog = Callable[[], Catalog]


@pytest.fixture(params=["sqlite", "postgres"])
def open_catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenCatalog]:
    opened: list[Catalog] = []
    if request.param == "sqlite":
        path = str(tmp_path / "catalog.sqlite")

        def make() -> Catalog:
            return Catalog(path)
    else:
        url = request.getfixturevalue("pg_url")

        def make() -> Catalog:
            return Catalog(leading_backend(url, str(tmp_path / "root")))

    def opener() -> Catalog:
        for c in opened:  # one leader at a time: a reopen closes the last one
            c.close()
        opened.clear()
        opened.append(make())
        return opened[-1]

    yield opener
    for c in opened:
        c.close()


def report(rank: int, size: int = 100) -> ShardReport:
    return ShardReport(
        shard_path=f"step-1/shard-{rank}",
        size=size,
        index_path=f"step-1/index-{rank}",
        index_size=10,
        index_blake3="ab" * 32,
        verify="full",
    )


def test_a_save_s_life_and_a_reopen(open_catalog: OpenCatalog) -> None:
    cat = open_catalog()
    assert cat.created

    async def go() -> None:
        await cat.set_generation("team/run", 3)
        await cat.record_attempt("team/run", "a1", 3)
        await cat.record_begin("team/run", 1, 3, 4, keep_last=2, parent=None)
        await cat.record_draft("team/run", 1, 3, {"state": {"k": [1, 2]}, "metadata": {}})
        await cat.record_reports([("team/run", 1, 3, r, report(r)) for r in (0, 1)])
        await cat.record_reports([("team/run", 1, 3, r, report(r)) for r in (1, 2, 3)])
        assert cat.reports("team/run", 1, 3) == {r: report(r) for r in range(4)}
        await cat.mark_committing("team/run", 1, 3)
        assert cat.save("team/run", 1).status == "COMMITTING"  # type: ignore[union-attr]
        await cat.mark_committed("team/run", 1, 3, "cd" * 32, 5 << 40)

    run(go())
    cat = open_catalog()  # durable: a new process would see the same
    assert not cat.created
    rec = cat.save("team/run", 1)
    assert rec is not None
    assert (rec.status, rec.generation, rec.world_size, rec.bytes) == ("COMMITTED", 3, 4, 5 << 40)
    assert rec.manifest_blake3 == "cd" * 32 and rec.draft is None and rec.keep_last == 2
    assert rec.committed_unix > rec.created_unix > 1e9
    assert cat.reports("team/run", 1, 3) == {}  # done with once committed
    assert cat.generation("team/run") == 3 and cat.attempt_generation("team/run", "a1") == 3
    assert cat.attempt_generation("team/run", "a2") is None and cat.generation("x") is None


def test_a_new_generation_replaces_the_row_whole(open_catalog: OpenCatalog) -> None:
    """record_begin of a step an older generation aborted: no column of the old row
    survives (SQLite's INSERT OR REPLACE; PostgreSQL's delete-then-insert)."""
    cat = open_catalog()

    async def go() -> None:
        await cat.record_begin("j", 7, 0, 2, keep_last=5, parent=6)
        await cat.record_draft("j", 7, 0, {"state": 1})
        await cat.mark_aborted("j", 7, 0, "rank 1 died")
        await cat.record_begin("j", 7, 1, 3)

    run(go())
    rec = cat.save("j", 7)
    assert rec is not None
    assert (rec.generation, rec.world_size, rec.status, rec.reason) == (1, 3, "OPEN", "")
    assert (rec.keep_last, rec.parent, rec.draft) == (0, None, None)


def test_wide_values_round_trip(open_catalog: OpenCatalog) -> None:
    """Steps, generations and byte counts past 32 bits; times to the microsecond; text
    in any script."""
    cat = open_catalog()
    gen, step = (1 << 62) - 1, 10**12

    async def go() -> None:
        await cat.set_generation("ünï/ジョブ", gen)
        await cat.record_begin("ünï/ジョブ", step, gen, 16384, parent=step - 1)
        await cat.mark_committed("ünï/ジョブ", step, gen, "ef" * 32, (1 << 53) + 1)

    run(go())
    rec = cat.save("ünï/ジョブ", step)
    assert rec is not None and cat.generation("ünï/ジョブ") == gen
    assert (rec.step, rec.generation, rec.bytes, rec.parent) == (step, gen, (1 << 53) + 1, step - 1)
    assert isinstance(rec.created_unix, float)


def test_listings_sort_bytewise(open_catalog: OpenCatalog) -> None:
    """jobs() and saves() in the same order on both (PostgreSQL's text compares bytewise,
    as SQLite's, whatever the database's locale)."""
    cat = open_catalog()
    names = ["b", "B", "a-b", "a/b", "a_b", "é", "Z", "a"]
    cat.found_job("unused", [], None)

    async def go() -> None:
        for n in names:
            await cat.record_begin(n, 2, 0, 1)
            await cat.record_begin(n, 1, 0, 1)

    run(go())
    assert cat.jobs() == sorted(names, key=lambda s: s.encode())
    assert [(r.job, r.step) for r in cat.saves()] == [
        (n, s) for n in sorted(names, key=lambda s: s.encode()) for s in (1, 2)
    ]
    assert [r.step for r in cat.saves("a", "OPEN")] == [1, 2]
    assert all(r.draft is None for r in cat.saves())  # listings leave the draft out


def test_a_duplicate_attempt_fails_naming_it(open_catalog: OpenCatalog) -> None:
    cat = open_catalog()
    run(cat.record_attempt("team/run", "a1", 0))
    with pytest.raises(CatalogError, match=r"job 'team/run' attempt 'a1': .*write"):
        run(cat.record_attempt("team/run", "a1", 1))
    assert cat.attempt_generation("team/run", "a1") == 0
    run(cat.record_attempt("team/run", "a2", 1))  # the catalog goes on after a failed write


def test_tiers_retiring_and_quarantine(open_catalog: OpenCatalog) -> None:
    cat = open_catalog()

    async def go() -> None:
        for s in (1, 2):
            await cat.record_begin("j", s, 0, 1)
            await cat.mark_committed("j", s, 0, "aa" * 32, 10)
        await cat.record_tier("j", 2, "s3", "s3://b/j", "UPLOADING")
        await cat.record_tier("j", 1, "s3", "s3://b/j", "UPLOADING")
        await cat.record_tier("j", 1, "s3", "s3://b/j", "FAILED", "slow\0down")
        await cat.record_tier("j", 1, "gs", "gs://b/j", "HELD")
        await cat.record_tier("j", 2, "s3", "s3://b/j", "REMOVED")
        await cat.mark_quarantined("j", 2, "block 3 of shard 0 does not hash")
        await cat.add_retiring("j", 1)
        await cat.add_retiring("j", 1)  # listed once, whatever retries do

    run(go())
    tiers = cat.tiers("j")
    assert [(t.step, t.tier, t.status) for t in tiers] == [(1, "gs", "HELD"), (1, "s3", "FAILED")]
    assert tiers[1].reason.startswith("slow") and tiers[1].reason.endswith("down")
    assert cat.save("j", 2).status == "QUARANTINED"  # type: ignore[union-attr]
    assert cat.retiring() == [("j", 1)]
    run(cat.forget_retired("j", 1))
    assert cat.retiring() == [] and cat.save("j", 1) is None
    assert [r.step for r in cat.saves("j")] == [2]


def test_a_rebuild_of_many_steps_in_one_transaction(open_catalog: OpenCatalog) -> None:
    cat = open_catalog()
    run(cat.record_begin("j", 5, 0, 1))  # an OPEN row storage's view replaces
    found = [
        SaveRecord(
            "j", s, 2, 4, "COMMITTED", "", 100 * s, 1.5 * s, 2.5 * s, f"{s:064x}", parent=s - 1
        )
        for s in range(1, 2001)
    ]
    cat.found_job("j", found, 2)
    assert cat.generation("j") == 2
    got = cat.saves("j")
    assert len(got) == 2000 and got[4].status == "COMMITTED" and got[4].generation == 2
    assert [dataclasses.replace(r, draft=None) for r in got] == found
    cat.found_job("j", found[:1], None)  # the generation is left alone without one
    assert cat.generation("j") == 2


def test_concurrent_writes_share_transactions(open_catalog: OpenCatalog) -> None:
    cat = open_catalog()

    async def go() -> None:
        await asyncio.gather(*(cat.record_begin("j", s, 0, 1) for s in range(1, 301)))
        await asyncio.gather(
            *(cat.record_reports([("j", s, 0, 0, report(0))]) for s in range(1, 301)),
            *(cat.mark_aborted("j", s, 0, "x") for s in range(1, 101)),
        )

    run(go())
    assert len(cat.saves("j", "OPEN")) == 200 and len(cat.saves("j", "ABORTED")) == 100
    assert cat.reports("j", 150, 0) == {0: report(0)} and cat.reports("j", 50, 0) == {}


def test_reports_of_a_schema_4_save_are_still_read(open_catalog: OpenCatalog) -> None:
    """A save in flight across the upgrade to schema 5 left per-rank `reports` rows."""
    cat = open_catalog()
    rep = '{"shard_path": "s", "size": 1, "index_path": "i", "index_size": 1, '
    rep += '"index_blake3": "", "verify": "size"}'
    cat.backend.transact([Sql("INSERT INTO reports VALUES (?, ?, ?, ?, ?)", ("j", 1, 0, 3, rep))])
    run(cat.record_reports([("j", 1, 0, 0, report(0))]))
    got = cat.reports("j", 1, 0)
    assert set(got) == {0, 3} and got[3].verify == "size"
    run(cat.mark_aborted("j", 1, 0, "gone"))
    assert cat.reports("j", 1, 0) == {}


def test_a_coordinator_recovers_from_either(open_catalog: OpenCatalog, tmp_path: Path) -> None:
    """A coordinator dies with two saves open, one fully reported (job a) and one not (job
    b); the next one on the same catalog commits the first and aborts the second."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)

    async def first() -> None:
        core = Coordinator(str(root), open_catalog(), lease_s=60)
        await core.start()
        for job, reported in (("a", 2), ("b", 1)):
            sims = [RankSim(core, str(root / job), r, 2) for r in range(2)]
            for s in sims:
                s.prepare({"w": torch.arange(100.0), "k": 7})
            await asyncio.gather(*(s.begin(1) for s in sims))
            for s in sims[:reported]:
                rep = await s.write(1)
                # Durable, as the core records a report; it dies before acting on it.
                await core.catalog.record_reports([(job, 1, 0, s.rank, rep)])
        await core.catalog.drain()
        if core._watchdog:
            core._watchdog.cancel()

    run(first())

    async def second() -> dict[str, str]:
        core = Coordinator(str(root), open_catalog(), lease_s=60)
        await core.start()
        out = {r.job: r.status for r in core.catalog.saves()}
        await core.close()
        return out

    assert run(second()) == {"a": "COMMITTED", "b": "ABORTED"}
    assert (root / "a" / "step-000000000001" / "MANIFEST.json").exists()
    assert not (root / "b" / "step-000000000001" / "MANIFEST.json").exists()


def test_an_end_to_end_save_on_either(open_catalog: OpenCatalog, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)

    async def go() -> list[str]:
        core = Coordinator(str(root), open_catalog(), lease_s=60)
        await core.start()
        try:
            sims = [RankSim(core, str(root / "job"), r, 2) for r in range(2)]
            got = []
            for step in (1, 2, 3):
                for s in sims:
                    s.prepare({"w": torch.arange(64.0) * step, "k": 7})
                got += await asyncio.gather(*(s.save(step, keep_last=2) for s in sims))
        finally:
            await core.close()  # retention (after each commit) has finished
        return [g.status for g in got] + [str(r.step) for r in core.catalog.saves("job")]

    assert run(go()) == ["COMMITTED"] * 6 + ["2", "3"]


# -- PostgreSQL only: the root, the leadership lock, fencing ----------------------------------


def test_a_catalog_refuses_another_root(pg_url: str, tmp_path: Path) -> None:
    leading_backend(pg_url, "/ckpts/a").close()
    with pytest.raises(CatalogError, match=r"belongs to the root /ckpts/a, not /ckpts/b"):
        leading_backend(pg_url, "/ckpts/b")


def test_one_leader_and_a_standby_that_writes_nothing(pg_url: str) -> None:
    from ckptd.coordinator.catalog_pg import PostgresBackend  # psycopg: optional extra

    leader = leading_backend(pg_url, "/r")
    standby = PostgresBackend(pg_url, root="/r", lease_s=10, address="127.0.0.1:9")
    try:
        assert not standby.try_lead(0.2)
        assert standby.leader() is not None and standby.leader()["pid"] > 0  # type: ignore[index]
        with pytest.raises(CatalogUnavailable, match="standby"):
            standby.transact([Sql("DELETE FROM jobs")])
        cat = Catalog(leader)
        run(cat.set_generation("j", 4))
        cat.close()  # the leader's session ends: PostgreSQL hands the lock on at once
        assert standby.try_lead(5)
        standby.migrate()
        cat2 = Catalog(standby)
        assert not cat2.created and cat2.generation("j") == 4
        assert standby.leader()["address"] == "127.0.0.1:9"  # type: ignore[index]
        run(cat2.set_generation("j", 5))
        cat2.close()
    finally:
        standby.close()


def test_a_leader_whose_session_ends_never_writes_again(pg_url: str, tally: Any) -> None:
    """PostgreSQL ends the leader's session (an operator, a network cut): its next write
    fails as unavailable, it stops leading for good (on_lost), and a standby leads; a
    write of the deposed leader, a commit included, never lands."""
    import psycopg  # the optional `postgres` extra

    from ckptd.coordinator.catalog_pg import PostgresBackend  # psycopg: optional extra

    leader = leading_backend(pg_url, "/r")
    lost: list[str] = []
    leader.on_lost = lost.append
    cat = Catalog(leader)
    run(cat.record_begin("j", 1, 0, 1))
    standby = PostgresBackend(pg_url, root="/r", lease_s=10)
    with tally.fault("catalog: the leader's PostgreSQL session terminated"):
        with psycopg.connect(pg_url, autocommit=True) as admin:
            pid = leader._writer.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert standby.try_lead(10)
        standby.migrate()
        with pytest.raises(CatalogUnavailable, match="job 'j' step 1: .*no longer leads"):
            run(cat.mark_committed("j", 1, 0, "aa" * 32, 1))
        assert lost and not leader.leading
        with pytest.raises(CatalogUnavailable, match="no longer leads"):
            run(cat.mark_aborted("j", 1, 0, "x"))
    cat2 = Catalog(standby)
    assert cat2.save("j", 1).status == "OPEN"  # type: ignore[union-attr]
    cat2.close()
    cat.close()


def test_a_session_that_lost_the_lock_cannot_commit(pg_url: str, tally: Any) -> None:
    """A pooler in transaction mode (or a reset) can leave the session alive without the
    lock: the fence at the head of every write transaction refuses it."""
    leader = leading_backend(pg_url, "/r")
    cat = Catalog(leader)
    run(cat.record_begin("j", 1, 0, 1))
    with tally.fault("catalog: the leader's session lost its advisory lock"):
        leader._writer.execute("SELECT pg_advisory_unlock_all()")
        with pytest.raises(CatalogUnavailable, match="no longer holds the catalog's leadership"):
            run(cat.mark_committed("j", 1, 0, "aa" * 32, 1))
    other = leading_backend(pg_url, "/r")  # the lock is free: another takes it
    assert Catalog(other).save("j", 1).status == "OPEN"  # type: ignore[union-attr]
    other.close()
    cat.close()


def test_an_unreachable_catalog_says_what_to_check(tally: Any, pg_server: Any) -> None:
    from ckptd.coordinator.catalog_pg import PostgresBackend  # psycopg: optional extra

    with tally.bad_input("catalog: a database that does not exist"):
        url = pg_server.url("no_such_db").replace("ckptd@", "ckptd:secret@")
        with pytest.raises(CatalogUnavailable) as e:
            PostgresBackend(url, root="/r")
    msg = str(e.value)
    assert "cannot reach the catalog" in msg and "createdb" in msg
    assert "secret" not in msg and "ckptd:***@127.0.0.1" in msg


def test_rebuild_catalog_on_postgres(pg_url: str, tmp_path: Path, capsys) -> None:
    """`ckptd rebuild-catalog --catalog postgresql://...` recreates the rows from storage,
    and is refused while a coordinator leads on the catalog."""
    from ckptd.cli import serve
    from ckptd.storage import JobLocation

    root = tmp_path / "root"
    root.mkdir()
    where = JobLocation.of(str(root)).path

    async def save() -> None:
        core = Coordinator(where, Catalog(leading_backend(pg_url, where)), lease_s=60)
        await core.start()
        sims = [RankSim(core, str(root / "job"), r, 1) for r in range(1)]
        for step in (1, 2):
            sims[0].prepare({"w": torch.arange(8.0) * step})
            assert (await sims[0].save(step)).status == "COMMITTED"
        await core.close()
        core.catalog.close()

    run(save())
    leader = leading_backend(pg_url, where)
    assert serve.main(["rebuild-catalog", "--root", where, "--catalog", pg_url]) == 1
    assert "stop every ckptd serve on it" in capsys.readouterr().err
    run(Catalog(leader).forget_retired("job", 1))  # a catalog that lost a row
    leader.close()
    assert serve.main(["rebuild-catalog", "--root", where, "--catalog", pg_url]) == 0
    assert "2 committed checkpoint(s)" in capsys.readouterr().out
    cat = Catalog(leading_backend(pg_url, where))
    assert [(r.step, r.status) for r in cat.saves("job")] == [(1, "COMMITTED"), (2, "COMMITTED")]
    assert not cat.created
    cat.close()


def test_serve_on_an_unreachable_catalog_says_so(pg_server: Any, tmp_path: Path, capsys) -> None:
    from ckptd.cli import serve

    url = pg_server.url("no_such_db")
    argv = ["serve", "--root", str(tmp_path), "--catalog", url, "--insecure-no-token"]
    assert serve.main([*argv, "--listen", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the catalog postgresql://") and "createdb" in err
