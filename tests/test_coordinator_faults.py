"""Faults with real processes: ranks killed mid-write, coordinators killed mid-save and
mid-commit and restarted on the same root, ranks of an older attempt woken up after the
job restarted.

The coordinator is `ckptd serve` (a subprocess, killed with SIGKILL or by a crash point
from ckptd.faults via CKPT_CRASH_AT in its environment); ranks are tests/ranks/plain_rank.py
processes (CKPTD_ADDRESS, CKPTD_TOKEN, CKPT_ATTEMPT). What must hold (DESIGN.md promises):
a save ends COMMITTED or ABORTED, never half; a committed step is never lost; an aborted
save leaves no debris after GC; a rank of an older generation can neither add to nor
commit a newer generation's checkpoint.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from coordinator_fixtures import (
    TOKEN,
    catalog_reports,
    ckptctl,
    read_catalog,
    step_files,
    wait_for,
)
from crash_harness import Job, assert_loads, wait_all

import ckpt

pytestmark = [pytest.mark.multiprocess]


@pytest.fixture
def fx(tmp_path: Path):
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.cleanup()


# ----------------------------------------------------------------------------- a rank dies


@pytest.mark.timeout(120)
def test_rank_killed_mid_write_aborts_within_lease(
    fx: Job, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    with tally.fault("crash:rank.mid_write"):
        lease = 2.0
        serve = fx.serve(lease_s=lease).start()
        ranks = fx.launch(
            serve,
            "a1",
            [
                {"save": 1, "seed": 1},
                {
                    "save": 2,
                    "seed": 2,
                    "crash_at": "rank.mid_write@1",
                },  # SIGKILL inside rank 1's write
                {"load": 1, "seed": 1},
                {"load": None, "seed": 1},
            ],
            lease_s=lease,
        )
        codes = wait_all(ranks, fx)
        assert codes[1] == -signal.SIGKILL, fx.logs()
        assert codes[0] == 0, fx.logs()
        r0 = ranks[0].result()["results"]
        assert [x["outcome"] for x in r0] == ["ok", "SaveAborted", "ok", "ok"], (r0, fx.logs())
        assert [x["outcome"] for x in ranks[1].result()["results"]] == ["ok"]  # died in save 2
        msg = r0[1]["message"]
        assert "rank(s) 1" in msg and "lease" in msg, msg
        # Aborted by the lease, not by the 60 s timeouts: within lease + a watchdog tick + slack.
        assert r0[1]["t1"] - r0[1]["t0"] < lease + 8, r0[1]
        assert r0[3]["step"] == 1  # the newest committed step is still step 1
        steps = fx.coordinator_steps(serve)
        assert steps[1]["status"] == "COMMITTED"
        assert steps[2]["status"] == "ABORTED" and "rank(s) 1" in steps[2]["reason"]
        assert not (fx.job / "step-000000000002" / "MANIFEST.json").exists()
        # The coordinator removed the aborted generation's shard files (rank 1's half-written one too).
        wait_for(lambda: step_files(fx.job, 2) == [], 10, "the aborted save's files to be removed")
        rc, out, err = ckptctl("gc", str(fx.job), "--include-newer")
        assert rc == 0, out + err
        assert not (fx.job / "step-000000000002").exists()
        assert fx.storage_steps() == {1: "COMMITTED"}
        rc, out, err = ckptctl("verify", str(fx.job), "--all")
        assert rc == 0, out + err
        assert serve.stop() == 0
        assert_loads(fx.job, 1, 1, 2, monkeypatch)


# ----------------------------------------------------------------------------- the coordinator dies


def _saves(steps_seeds):
    return [{"save": st, "seed": sd} for st, sd in steps_seeds]


@pytest.mark.timeout(180)
def test_coordinator_killed_mid_commit_recovers(
    fx: Job, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """Life 1 dies right after the manifest rename (catalog still COMMITTING); life 2 dies
    in the middle of writing the manifest (all reports durable); each restart ends the
    save COMMITTED, and the ranks, retrying, are told so."""
    with (
        tally.fault("crash:coordinator.after_manifest_rename"),
        tally.fault("crash:coordinator.mid_manifest"),
    ):
        serve = fx.serve(lease_s=30)
        cat = serve.catalog
        serve.start(env={"CKPT_CRASH_AT": "coordinator.after_manifest_rename"})
        ranks = fx.launch(
            serve,
            "a1",
            [*_saves([(1, 1), (2, 2), (3, 3)]), {"load": None, "seed": 3}, {"load": 1, "seed": 1}],
        )

        assert serve.wait_dead(60) == -signal.SIGKILL, serve.log()
        assert (fx.job / "step-000000000001" / "MANIFEST.json").exists()
        assert read_catalog(cat)[1]["status"] == "COMMITTING"
        serve.start(env={"CKPT_CRASH_AT": "coordinator.mid_manifest"})

        assert serve.wait_dead(60) == -signal.SIGKILL, serve.log()
        assert not (fx.job / "step-000000000002" / "MANIFEST.json").exists()
        assert read_catalog(cat)[2]["status"] == "COMMITTING" and catalog_reports(cat, 2) == 2
        assert read_catalog(cat)[1]["status"] == "COMMITTED"  # recovered by life 2
        serve.start()

        codes = wait_all(ranks, fx)
        assert codes == [0, 0], fx.logs()
        for r in ranks:
            assert r.outcomes() == ["ok"] * 5, (r.result(), fx.logs())
        assert ranks[0].result()["results"][3]["step"] == 3
        steps = fx.coordinator_steps(serve)
        assert {s: v["status"] for s, v in steps.items()} == {
            1: "COMMITTED",
            2: "COMMITTED",
            3: "COMMITTED",
        }
        assert "restart" in steps[2]["reason"]
        assert fx.storage_steps() == {1: "COMMITTED", 2: "COMMITTED", 3: "COMMITTED"}
        rc, out, err = ckptctl("verify", str(fx.job), "--all")
        assert rc == 0, out + err
        assert serve.stop() == 0
        for step in (1, 2, 3):
            assert_loads(fx.job, step, step, 2, monkeypatch)


@pytest.mark.timeout(180)
def test_coordinator_killed_mid_save_aborts_and_nothing_committed_is_lost(
    fx: Job, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """Step 1 commits. Step 2: rank 1 stops after writing, rank 0 has reported; the
    coordinator is SIGKILLed; after the restart the save is ABORTED (1 of 2 reported) and
    both ranks are told. Step 3: the coordinator dies right after planning
    (coordinator.after_barrier); after the restart it is ABORTED. Step 4 commits."""
    with tally.fault("kill:coordinator"), tally.fault("crash:coordinator.after_barrier"):
        serve = fx.serve(lease_s=30)
        cat = serve.catalog
        serve.start()
        actions = [
            {"save": 1, "seed": 1},
            {"save": 2, "seed": 2, "pause": "after_write"},  # rank 1 only
            {"save": 3, "seed": 3},
            {"save": 4, "seed": 4},
            {"load": 1, "seed": 1},
            {"load": None, "seed": 4},
        ]
        no_pause = [{k: v for k, v in a.items() if k != "pause"} for a in actions]
        ranks = fx.launch(serve, "a1", no_pause, only={1: actions})

        ranks[1].wait_paused(1)
        wait_for(lambda: catalog_reports(cat, 2) == 1, 30, "rank 0's report of step 2")
        assert read_catalog(cat)[1]["status"] == "COMMITTED"
        serve.kill()
        serve.start(env={"CKPT_CRASH_AT": "coordinator.after_barrier"})
        assert read_catalog(cat)[2]["status"] == "ABORTED"
        ranks[1].resume()

        assert serve.wait_dead(60) == -signal.SIGKILL, serve.log()  # planned step 3, then died
        assert read_catalog(cat)[3]["status"] == "OPEN"
        serve.start()
        assert read_catalog(cat)[3]["status"] == "ABORTED"

        codes = wait_all(ranks, fx)
        assert codes == [0, 0], fx.logs()
        for r in ranks:
            assert r.outcomes() == ["ok", "SaveAborted", "SaveAborted", "ok", "ok", "ok"], (
                r.result(),
                fx.logs(),
            )
            res = r.result()["results"]
            assert "restart" in res[1]["message"] and "1 of 2" in res[1]["message"], res[1]
            assert "restart" in res[2]["message"] and "0 of 2" in res[2]["message"], res[2]
            assert res[5]["step"] == 4
        steps = fx.coordinator_steps(serve)
        assert {s: v["status"] for s, v in steps.items()} == {
            1: "COMMITTED",
            2: "ABORTED",
            3: "ABORTED",
            4: "COMMITTED",
        }
        for step in (2, 3):
            assert not (fx.job / f"step-{step:012d}" / "MANIFEST.json").exists()
            assert step_files(fx.job, step) == []
        rc, out, err = ckptctl("gc", str(fx.job))
        assert rc == 0, out + err
        assert fx.storage_steps() == {1: "COMMITTED", 4: "COMMITTED"}
        rc, out, err = ckptctl("verify", str(fx.job), "--all")
        assert rc == 0, out + err
        assert serve.stop() == 0
        assert_loads(fx.job, 1, 1, 2, monkeypatch)
        assert_loads(fx.job, 4, 4, 2, monkeypatch)


# ----------------------------------------------------------------------------- a stale rank wakes up


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory):
    """Attempt a1 (generation 0) saves step 1; in step 2 its rank 1 stops (SIGSTOP) before
    writing, rank 0 has reported. The job restarts as attempt a2 (generation 1), which
    saves step 2 and loads it. Then the old rank 1 is resumed (SIGCONT): it writes its
    shard and reports, then tries step 3."""
    fx = Job(tmp_path_factory.mktemp("stale"))
    try:
        serve = fx.serve(lease_s=60).start()
        plain = [{"save": 1, "seed": 1}, {"save": 2, "seed": 2}, {"save": 3, "seed": 3}]
        pausing = [plain[0], {**plain[1], "pause": "before_write"}, plain[2]]
        old = fx.launch(serve, "a1", plain, tag="-old", only={1: pausing})
        old[1].wait_paused(1)
        wait_for(
            lambda: catalog_reports(serve.catalog, 2) == 1, 30, "old rank 0's report of step 2"
        )
        new = fx.launch(serve, "a2", [{"save": 2, "seed": 20}, {"load": 2, "seed": 20}], tag="-new")
        new_codes = wait_all(new, fx)
        files_before_wakeup = step_files(fx.job, 2)
        old[1].resume()
        old_codes = wait_all(old, fx)
        steps = fx.coordinator_steps(serve)
        yield {
            "fx": fx,
            "serve": serve,
            "old": old,
            "new": new,
            "old_codes": old_codes,
            "new_codes": new_codes,
            "steps": steps,
            "files_before_wakeup": files_before_wakeup,
        }
    finally:
        for s in fx.serves:
            s.stop()
        fx.cleanup()


@pytest.mark.timeout(180)
def test_stale_rank_is_fenced(stale) -> None:
    fx, old, new = stale["fx"], stale["old"], stale["new"]
    assert stale["new_codes"] == [0, 0] and stale["old_codes"] == [0, 0], fx.logs()
    assert [r.result()["generation"] for r in old] == [0, 0]
    assert [r.result()["generation"] for r in new] == [1, 1]
    for r in new:
        assert r.outcomes() == ["ok", "ok"], (r.result(), fx.logs())
    # Old rank 0 was waiting for step 2's commit: the new generation aborted it.
    o0 = old[0].result()["results"]
    assert [x["outcome"] for x in o0] == ["ok", "SaveAborted", "StaleGeneration"], o0
    assert "generation 1" in o0[1]["message"]
    # Old rank 1, woken up: its report is refused, and so is its next save.
    o1 = old[1].result()["results"]
    assert [x["outcome"] for x in o1] == ["ok", "StaleGeneration", "StaleGeneration"], o1
    assert "generation 0 is older" in o1[1]["message"]


@pytest.mark.timeout(60)
def test_stale_rank_cannot_touch_the_new_checkpoint(stale, monkeypatch: pytest.MonkeyPatch) -> None:
    fx, steps = stale["fx"], stale["steps"]
    assert steps[1]["status"] == "COMMITTED" and steps[1]["generation"] == 0
    assert steps[2]["status"] == "COMMITTED" and steps[2]["generation"] == 1
    assert 3 not in steps  # the stale rank's step 3 never began
    m = json.loads((fx.job / "step-000000000002" / "MANIFEST.json").read_text())
    assert m["generation"] == 1
    assert [s["path"] for s in m["shards"]] == [
        "shards/rank-00000.g1.bin",
        "shards/rank-00001.g1.bin",
    ]
    rc, out, err = ckptctl("verify", str(fx.job), "--all")
    assert rc == 0, out + err
    assert_loads(fx.job, 2, 20, 2, monkeypatch)  # the new attempt's values, not the old one's
    assert_loads(fx.job, 1, 1, 2, monkeypatch)
    assert not (fx.job / "step-000000000003").exists()


@pytest.mark.timeout(60)
def test_job_outside_root_is_refused_by_the_service(stale, tmp_path: Path) -> None:
    serve = stale["serve"]
    outside = tmp_path / "elsewhere" / "job"
    with pytest.raises(ckpt.UnsafePath, match="outside"):
        ckpt.Checkpointer(outside, coordinator=serve.address, token=TOKEN, attempt="x")
    rc, out, err = ckptctl("list", str(outside), "--coordinator", serve.address, "--token", TOKEN)
    assert rc != 0 and "outside" in err, out + err
    assert not outside.exists()


@pytest.mark.timeout(60)
def test_stale_rank_leaves_no_debris_after_gc(stale) -> None:
    """The woken rank's generation-0 files must not stay inside step 2, which generation 1
    committed (found by these tests; fixed in e63eadc)."""
    fx = stale["fx"]
    assert stale["files_before_wakeup"] == [
        "MANIFEST.json",
        "shards/rank-00000.g1.bin",
        "shards/rank-00000.g1.json",
        "shards/rank-00001.g1.bin",
        "shards/rank-00001.g1.json",
    ]
    rc, out, err = ckptctl("gc", str(fx.job))
    assert rc == 0, out + err
    left = step_files(fx.job, 2)
    if left != stale["files_before_wakeup"]:
        pytest.fail(f"after gc, step 2 still holds the stale rank's files: {left}", pytrace=False)
