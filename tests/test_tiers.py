# ruff: noqa: F811 - pytest fixtures imported from s3_server are used as parameters
"""Tiers: a fast local directory plus a mirror (S3 on a real moto server, or memory://).

Commit locally, copy to the mirror in the background (read back and verified there),
record it in the catalog; retention per tier; a damaged or missing local copy loads the
mirror's copy instead, bit-exact, and is quarantined. memory:// stands in for gs://
(there is no GCS server to run here); both go through the same FsspecStorage code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from ckpt_testutil import assert_same, flip_bit
from s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures

import ckpt
from ckpt._mirror import MirrorUploader
from ckptd.coordinator import catalog as catalog_mod
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.format.mirror import mirror_step
from ckptd.storage import JobLocation, open_storage
from ckptd.storage.fsspec_store import FsspecStorage

MEM = fsspec.filesystem("memory")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(20_000, generator=g), "b": torch.randn(7, generator=g)},
        "opt": {"lr": 0.01 * step, "step": step},
    }


def empty_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(20_000), "b": torch.zeros(7)}, "opt": {}}


def steps_of(url: str) -> list[int]:
    return [s.step for s in ckfmt.list_steps(open_storage(url)) if s.status == ckfmt.COMMITTED]


def tier_rows(job: str) -> list[tuple[int, str, str]]:
    db = sqlite3.connect(JobLocation.of(job).catalog_path())
    try:
        return db.execute("SELECT step, tier, status FROM tiers ORDER BY step").fetchall()
    finally:
        db.close()


def flip_local_shard(job: str, step: int) -> None:
    path = os.path.join(job, layout.step_dir(step), layout.shard_name(0))
    with open(path, "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0x01]))


def save_all(cp: ckpt.Checkpointer, steps: range) -> None:
    for s in steps:
        cp.save(state_for(s), s, blocking=True)
        assert cp._mirror is not None and cp._mirror.wait(60)


def test_s3_mirror_retention_catalog_and_list(s3_bucket, job, ckptctl):
    mirror = f"s3://{s3_bucket}/runs/job"
    with ckpt.Checkpointer(job, keep_last=2, mirror=mirror, mirror_keep_last=3) as cp:
        save_all(cp, range(1, 6))
        assert not cp._mirror.failures
        res = cp._mirror.results[5]
    assert steps_of(job) == [4, 5]
    assert steps_of(mirror) == [3, 4, 5]
    assert tier_rows(job) == [(s, "mirror", "HELD") for s in (3, 4, 5)]
    assert res.bytes > 80_000 and not res.already_there
    rc, out, err = ckptctl("verify", mirror, "--all")
    assert rc == 0, err
    rc, out, err = ckptctl("list", job, "--mirror", mirror, "--json")
    assert rc == 0, err
    got = {s["step"]: s["tiers"] for s in json.loads(out)["steps"]}
    assert got == {3: ["mirror"], 4: ["local", "mirror"], 5: ["local", "mirror"]}
    rc, out, _ = ckptctl("list", job, "--mirror", mirror)
    assert "TIERS" in out and "local,mirror" in out
    # The mirror alone restores, bit-exact (e.g. on a new machine).
    assert_same(ckpt.load({}, mirror, step=3).state, state_for(3))


def test_corrupt_local_step_resumes_from_the_mirror(s3_bucket, job):
    mirror = f"s3://{s3_bucket}/job"
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        save_all(cp, range(1, 3))
    flip_local_shard(job, 2)
    for _ in range(2):  # a second restart must not loop or lose step 2
        state = empty_state()
        with ckpt.Checkpointer(job, mirror=mirror) as cp:
            assert cp.resume(state) == 2
        assert_same(state, state_for(2))
    local = {s.step: s.status for s in ckfmt.list_steps(open_storage(job))}
    assert local == {1: ckfmt.COMMITTED, 2: ckfmt.QUARANTINED}
    reason = ckfmt.quarantine_reason(open_storage(job), 2) or ""
    assert "rank-00000.bin" in reason and "model/w" in reason
    db = sqlite3.connect(JobLocation.of(job).catalog_path())
    try:
        row = db.execute("SELECT status FROM saves WHERE step=2").fetchone()
    finally:
        db.close()
    assert row == ("QUARANTINED",)
    assert steps_of(mirror) == [1, 2]  # the mirror's copy is untouched


def test_wiped_local_tier_resumes_from_the_mirror(mem_mirror, job):
    with ckpt.Checkpointer(job, keep_last=1, mirror=mem_mirror) as cp:
        save_all(cp, range(1, 4))
    for name in os.listdir(job):
        if name.startswith("step-"):
            shutil.rmtree(os.path.join(job, name))
    state = empty_state()
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        assert cp.resume(state) == 3
        assert_same(state, state_for(3))
        # An explicit older step that only the mirror holds loads too.
        assert_same(cp.load({}, step=1).state, state_for(1))


def test_both_copies_bad_falls_back_to_an_older_step(mem_mirror, job):
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        save_all(cp, range(1, 3))
    flip_local_shard(job, 2)
    p = f"/{mem_mirror[len('memory://') :]}/{layout.step_dir(2)}/{layout.shard_name(0)}"
    data = bytearray(MEM.cat_file(p))
    data[64] ^= 1
    MEM.pipe_file(p, bytes(data))
    state = empty_state()
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        assert cp.resume(state) == 1
    assert_same(state, state_for(1))
    assert ckfmt.quarantine_reason(open_storage(mem_mirror), 2) is not None
    assert ckfmt.quarantine_reason(open_storage(job), 2) is not None


def test_no_fallback_with_a_mirror_stays_at_the_newest_step(mem_mirror, job):
    """fallback=False: both copies of the newest step are tried, never an older step."""
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        save_all(cp, range(1, 3))
    flip_local_shard(job, 2)
    p = f"/{mem_mirror[len('memory://') :]}/{layout.step_dir(2)}/{layout.shard_name(0)}"
    data = bytearray(MEM.cat_file(p))
    data[64] ^= 1
    MEM.pipe_file(p, bytes(data))
    state = empty_state()
    with ckpt.Checkpointer(job, mirror=mem_mirror) as cp:
        with pytest.raises(ckpt.CorruptCheckpoint, match="step 2"):
            cp.load(state, fallback=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mirror_down_training_goes_on(job, caplog):
    down = FsspecStorage(
        "s3://nowhere/job",
        endpoint_url=f"http://127.0.0.1:{_closed_port()}",
        retries=1,
        config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}},
    )
    with ckpt.Checkpointer(job, mirror=down) as cp:
        assert cp._mirror is not None
        cp._mirror.backoff_s = 0.01
        for s in (1, 2):
            r = cp.save(state_for(s), s).wait()  # commits locally whatever the mirror does
            assert r is not None and r.step == s
            assert cp._mirror.wait(60)
        failures = dict(cp._mirror.failures)
        # Loads do not depend on the mirror either: the local copy is nearest.
        assert cp.load({}).step == 2
        assert "s3://nowhere/job cannot be listed" in caplog.text
    where = f"job {os.path.realpath(job)} step 1 -> mirror s3://nowhere/job: upload FAILED"
    assert where in caplog.text
    assert steps_of(job) == [1, 2]
    assert set(failures) == {1, 2}
    assert all(f for f in failures.values())
    assert tier_rows(job) == [(1, "mirror", "FAILED"), (2, "mirror", "FAILED")]


def test_mirror_behind_skips_to_the_newest_step(mem_mirror, job):
    src = open_storage(job, create=True)
    for s in (1, 2, 3):
        ckpt.save(state_for(s), job, step=s)
    seen: list[tuple[int, str]] = []
    up = MirrorUploader(
        src, open_storage(mem_mirror), job=job, record=lambda s, st, r: seen.append((s, st))
    )
    with up._cv:  # hold the thread while three commits arrive
        up.submit(1)
        up.submit(2)
        up.submit(3)
    assert up.wait(30)
    up.close(5)
    assert steps_of(mem_mirror) == [3]
    assert up.skipped == [1, 2]
    assert seen == [(3, "UPLOADING"), (3, "HELD")]


class _Mangling(FsspecStorage):
    """A store that damages one byte of every shard it is given (a bad proxy, a bad disk)."""

    def put_files(self, pairs: list[tuple[str, str]]) -> None:
        super().put_files(pairs)
        for _, rel in pairs:
            if rel.endswith(".bin"):
                data = bytearray(self.fs.cat_file(self.full(rel)))
                data[10] ^= 0xFF
                self.fs.pipe_file(self.full(rel), bytes(data))


def test_read_back_catches_a_bad_upload(mem_mirror, job):
    ckpt.save(state_for(1), job, step=1)
    dst = _Mangling(mem_mirror)
    with pytest.raises(ckpt.CorruptCheckpoint) as ei:
        mirror_step(open_storage(job), dst, 1, job="j")
    msg = str(ei.value)
    assert "job j step 1" in msg and "rank-00000.bin" in msg and mem_mirror in msg
    assert not dst.exists(f"{layout.step_dir(1)}/{layout.MANIFEST_NAME}")
    assert steps_of(mem_mirror) == []
    # A good store then takes the step (the debris of the bad copy is cleared first), and
    # a second copy is a no-op.
    good = open_storage(mem_mirror)
    assert mirror_step(open_storage(job), good, 1).bytes > 0
    assert mirror_step(open_storage(job), good, 1).already_there
    assert_same(ckpt.load({}, mem_mirror).state, state_for(1))


def test_schema_1_catalog_is_migrated(tmp_path):
    path = str(tmp_path / "catalog.sqlite")
    db = sqlite3.connect(path)
    db.executescript(catalog_mod.SCHEMA)  # what a schema-1 catalog holds
    db.execute(
        "INSERT INTO saves (job, step, generation, world_size, status, created_unix) "
        "VALUES ('j', 1, 0, 1, 'COMMITTED', 0)"
    )
    db.commit()
    db.close()
    cat = catalog_mod.Catalog(path)
    try:
        assert [r.step for r in cat.saves("j")] == [1]
        assert cat.tiers("j") == []
        assert cat.db.execute("PRAGMA user_version").fetchone()[0] == catalog_mod.SCHEMA_VERSION
    finally:
        cat.close()


def test_a_served_coordinator_records_the_mirror(tmp_path, mem_mirror):
    from coordinator_fixtures import ServerThread

    root = tmp_path / "root"
    root.mkdir()
    srv = ServerThread(root)
    try:
        job = str(root / "job")
        with ckpt.Checkpointer(job, coordinator=srv.address, attempt="a1", mirror=mem_mirror) as cp:
            save_all(cp, range(1, 3))
        rows = [(r.step, r.tier, r.url, r.status) for r in srv.core.catalog.tiers("job")]
    finally:
        srv.stop()
    assert rows == [(1, "mirror", mem_mirror, "HELD"), (2, "mirror", mem_mirror, "HELD")]


_MIRROR_RANK = textwrap.dedent(
    """
    import sys, torch, ckpt
    from ckptd import knobs
    job, mirror = sys.argv[1], sys.argv[2]
    with knobs.override(upload_part_size=5 << 20, upload_concurrency=1):
        cp = ckpt.Checkpointer(job, mirror=mirror, verify="size")
        cp.save({"w": torch.arange(1000, dtype=torch.float32)}, 1, blocking=True)
        assert cp._mirror.wait(60)
        big = {"w": torch.randn((16 << 20) // 4, generator=torch.Generator().manual_seed(2))}
        cp.save(big, 2, blocking=True)
        print("step 2 committed locally", flush=True)
        cp._mirror.wait(120)
        print("step 2 mirrored (the kill came too late)", flush=True)
    """
)


@pytest.mark.slow  # a second process importing torch; the storage-level kill runs by default
@pytest.mark.multiprocess
def test_kill_during_the_mirror_upload(s3_server, s3_bucket, job, tmp_path):
    mirror = f"s3://{s3_bucket}/job"
    script = tmp_path / "rank.py"
    script.write_text(_MIRROR_RANK)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO}/clients/python"}
    proc = subprocess.Popen(
        [sys.executable, str(script), job, mirror],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client = s3_server.client()
    seen = False
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and not seen:
            for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []):
                parts = client.list_parts(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"])
                seen = seen or bool(parts.get("Parts"))
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    assert seen and proc.returncode == -signal.SIGKILL, (out, err[-3000:])
    assert b"step 2 committed locally" in out and b"mirrored" not in out
    assert steps_of(job) == [1, 2]
    assert steps_of(mirror) == [1]  # the half copy is not a checkpoint there
    want = ckpt.load({}, job, step=2).state
    # The next run redoes the copy, verified, and the mirror's step 2 equals the local one.
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        assert cp._mirror is not None and cp._mirror.wait(120)
        assert not cp._mirror.failures
    assert steps_of(mirror) == [1, 2]
    assert_same(ckpt.load({}, mirror, step=2).state, want)


def test_the_default_checkpointer_takes_a_mirror(mem_mirror, job):
    cp = ckpt.init(job, mirror=mem_mirror, mirror_keep_last=1)
    try:
        for s in (1, 2):
            ckpt.save(state_for(s), step=s)
            ckpt.wait()
            assert cp._mirror is not None and cp._mirror.wait(30)
    finally:
        cp.close()
    assert steps_of(job) == [1, 2]
    assert steps_of(mem_mirror) == [2]


def _spawn(phase: str, job: str, mirror: str, out: str, world: int = 2) -> list[dict[str, Any]]:
    import multiprocessing as mp

    from coordinator_fixtures import free_port
    from ranks import tier_worker

    os.makedirs(out, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=tier_worker.spawn_entry,
            args=(r, world, port, phase, job, mirror, out),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(10)
    logs = "\n".join(
        f"--- rank {r}\n{Path(out, f'rank{r}.log').read_text(errors='replace')}"
        for r in range(world)
        if Path(out, f"rank{r}.log").exists()
    )
    assert not hung, f"{phase}: ranks hung:\n{logs}"
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["error"] is None for r in results), logs
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_agree_on_the_mirror_copy(tmp_path):
    job, mirror = str(tmp_path / "job"), str(tmp_path / "mirror")
    saved = _spawn("save", job, mirror, str(tmp_path / "save"))
    # Each rank uploaded its own shard, reading only its own files of the local tier
    # (the worker's OwnFilesOnly refuses the other's, as a node's own disk would).
    assert [r["mirror_failures"] for r in saved] == [{}, {}]
    assert steps_of(mirror) == [1, 2]
    # Only rank 1's shard is damaged: rank 0's reads succeed, rank 1's fail; both must
    # move to the mirror's copy of step 2 together.
    flip_bit(os.path.join(job, layout.step_dir(2), layout.shard_name(1)), 32)
    resumed = _spawn("resume", job, mirror, str(tmp_path / "resume"))
    assert [(r["step"], r["exact"]) for r in resumed] == [(2, True), (2, True)]
    assert ckfmt.quarantine_reason(open_storage(job), 2) is not None
    assert ckfmt.quarantine_reason(open_storage(mirror), 2) is None


@pytest.mark.multiprocess
def test_two_ranks_save_a_step_again_over_its_quarantined_copies_in_both_tiers(tmp_path):
    """Step 2 damaged in both tiers (rank 1's shard): both ranks resume from step 1 and
    save step 2 again. Each rank uploads its own shard to the mirror while rank 0 removes
    the quarantined copy there (retention.make_way), then commits the new one."""
    job, mirror = str(tmp_path / "job"), str(tmp_path / "mirror")
    _spawn("save", job, mirror, str(tmp_path / "save"))
    for root in (job, mirror):
        flip_bit(os.path.join(root, layout.step_dir(2), layout.shard_name(1)), 32)
    again = _spawn("resave", job, mirror, str(tmp_path / "resave"))
    assert [(r["step"], r["mirror_failures"]) for r in again] == [(1, {}), (1, {})]
    for root in (job, mirror):
        assert ckfmt.quarantine_reason(open_storage(root), 2) is None
    manifest = os.path.join(layout.step_dir(2), layout.MANIFEST_NAME)
    with (
        open(os.path.join(job, manifest), "rb") as a,
        open(os.path.join(mirror, manifest), "rb") as b,
    ):
        assert a.read() == b.read()
    assert ckpt.load({}, mirror, step=2).state["rep"][1].item() == 2.0
