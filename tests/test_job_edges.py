"""Where a job lives, at its edges: a job open in two processes, read-only storage, a path
that is a file or an unknown URL, and `ckptd serve` given a bad address, a busy port, a
missing root or another server's catalog.

Real processes (a second Python holding the job; `ckptd serve` subprocesses), a real
read-only tmpfs (root only), real sockets.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import Serve, child_env, free_port, wait_for

import ckpt
from ckptd.cli import serve as serve_cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)


def _w(x: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), x)}


# ----------------------------------------------------------------------------- two processes

HOLDER = textwrap.dedent(
    """
    import sys, time, torch, ckpt
    cp = ckpt.Checkpointer(sys.argv[1], keep_last=2)
    cp.save({"w": torch.full((4,), 1.0)}, 1, blocking=True)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _holder(job: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, job],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + proc.stdout.read()
    return proc


def test_a_job_open_in_another_process_is_refused_until_it_dies(tmp_path: Path, tally) -> None:
    job = str(tmp_path / "job")
    proc = _holder(job)
    try:
        with tally.bad_input("job-open-twice"):
            for open_it in (
                lambda: ckpt.Checkpointer(job),
                lambda: ckpt.save(_w(2.0), job, step=2),
            ):
                with pytest.raises(ckpt.JobInUse) as ei:
                    open_it()
                msg = str(ei.value)
                assert job in msg and f"pid {proc.pid}" in msg, msg
                assert "ckptd serve" in msg and "close" in msg, msg
            # The holder's committed step is untouched, nothing of step 2 was written.
            assert sorted(n for n in os.listdir(job) if n.startswith("step-")) == [
                "step-000000000001"
            ]
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    with tally.fault("kill:job-holder"):
        # SIGKILL left no stale lock: the job opens at once, and recovers the holder's work.
        with ckpt.Checkpointer(job, keep_last=2) as cp:
            assert cp.load(_w(0.0)).step == 1
            for step in (2, 3, 4):
                cp.save(_w(float(step)), step, blocking=True)
        assert [s for s in sorted(os.listdir(job)) if s.startswith("step-")] == [
            "step-000000000003",
            "step-000000000004",
        ]


RANK = textwrap.dedent(
    """
    import sys, time, torch.distributed as dist, ckpt
    dist.init_process_group("gloo")
    t0 = time.monotonic()
    try:
        ckpt.Checkpointer(sys.argv[1])
    except ckpt.CkptError as e:
        print(f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        sys.exit(3)
    sys.exit(0)
    """
)


def test_every_rank_of_a_second_job_hears_why_at_once(tmp_path: Path, tally) -> None:
    """Rank 0 cannot host the coordinator (the job is open elsewhere): the other ranks,
    waiting for its address in the store, get the reason too, within seconds."""
    job = str(tmp_path / "job")
    holder = _holder(job)
    port = free_port()
    try:
        with tally.bad_input("job-open-twice"):
            ranks = [
                subprocess.Popen(
                    [sys.executable, "-c", RANK, job],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=child_env(
                        RANK=str(r),
                        WORLD_SIZE="2",
                        LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                    ),
                )
                for r in range(2)
            ]
            outs = [p.communicate(timeout=60)[0] for p in ranks]
            assert [p.returncode for p in ranks] == [3, 3], outs
            assert outs[0].startswith("JobInUse"), outs[0]
            assert "rank 1 of 2" in outs[1] and "rank 0 could not host" in outs[1], outs[1]
            for out in outs:
                assert job in out and f"pid {holder.pid}" in out, out
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def test_checkpointers_of_one_process_share_one_coordinator(tmp_path: Path) -> None:
    """Two Checkpointers and a module-level save of one job in one process: one coordinator
    (one catalog view, keep_last applied across them); the newer attempt fences the older,
    as two clients of one `ckptd serve` would."""
    job = str(tmp_path / "job")
    first = ckpt.Checkpointer(job)
    try:
        first.save(_w(1.0), 1, blocking=True)
        with ckpt.Checkpointer(job) as second:
            assert second.address == first.address  # the same embedded coordinator
            second.save(_w(2.0), 2, blocking=True)
            ckpt.save(_w(3.0), job, step=3, keep_last=2)
            wait_for(  # retention runs after the commit is answered
                lambda: [r.step for r in second.client.list_checkpoints(job)] == [2, 3],
                10,
                "keep_last=2 over the steps of both Checkpointers",
            )
            with pytest.raises(ckpt.StaleGeneration, match="fenced"):
                first.save(_w(4.0), 4, blocking=True)
    finally:
        first.close()
    assert ckpt.load({}, job).step == 3


# ----------------------------------------------------------------------------- read-only storage


@pytest.fixture
def read_only_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A job with steps 1 and 2 on a real tmpfs, then remounted read-only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        job = str(d / "job")
        for step in (1, 2):
            ckpt.save(_w(float(step)), job, step=step)
        r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only ({r.stderr.strip()})")
        monkeypatch.delenv("CKPTD_CATALOG_DIR", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the catalog cache goes here
        yield job
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_resume_and_load_from_read_only_storage(
    read_only_job: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, tally
) -> None:
    job = read_only_job
    with tally.fault("read-only-storage"), caplog.at_level(logging.INFO, logger="ckpt"):
        with ckpt.Checkpointer(job) as cp:
            state = _w(0.0)
            assert cp.load(state).step == 2 and torch.equal(state["w"], _w(2.0)["w"])
            assert [r.step for r in cp.client.list_checkpoints(job)] == [1, 2]
            with pytest.raises(ckpt.StorageError) as ei:
                cp.save(_w(3.0), 3, blocking=True)
            assert ei.value.errno == errno.EROFS and job in str(ei.value), ei.value
        assert any("read-only" in r.getMessage() for r in caplog.records), caplog.text
        assert any((tmp_path / "home" / ".cache" / "ckptd").rglob("catalog.sqlite"))
        with pytest.raises(ckpt.StorageError) as ei:
            ckpt.save(_w(3.0), job, step=3)
        assert ei.value.errno == errno.EROFS and job in str(ei.value), ei.value
        default = ckpt.init(job)
        try:
            state = _w(0.0)
            assert ckpt.resume(state) == 2 and torch.equal(state["w"], _w(2.0)["w"])
        finally:
            default.close()


# ----------------------------------------------------------------------------- paths that are not jobs


def test_a_path_that_is_a_file_or_an_unknown_url(tmp_path: Path, tally) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a job")
    for path, expect in (
        (str(a_file), "is a file, not a directory"),
        (str(a_file / "job"), "is a file, not a directory"),
        ("fooo://bucket/job", "'fooo'"),
    ):
        with tally.bad_input("job-path-not-a-directory"):
            for open_it in (
                lambda p: ckpt.Checkpointer(p),
                lambda p: ckpt.save(_w(1.0), p, step=1),
            ):
                with pytest.raises(ckpt.StorageError) as ei:
                    open_it(path)
                msg = str(ei.value)
                assert path.split("/job")[0] in msg and expect in msg, msg
    assert a_file.read_text() == "not a job"


# ----------------------------------------------------------------------------- ckptd serve


def _serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = serve_cli.main(["serve", "--insecure-no-token", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def test_serve_refuses_a_missing_root_and_a_bad_listen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tally
) -> None:
    missing = tmp_path / "ckpst"  # a typo
    with tally.bad_input("serve:bad-argument"):
        rc, err = _serve(capsys, "--root", str(missing), "--listen", "127.0.0.1:0")
        assert rc == 2 and f"--root {missing} does not exist" in err, err
        assert "--create-root" in err and not missing.exists()
    (tmp_path / "root").mkdir()
    for listen in ("notahostport", "127.0.0.1:http", "127.0.0.1:99999"):
        with tally.bad_input("serve:bad-argument"):
            rc, err = _serve(capsys, "--root", str(tmp_path / "root"), "--listen", listen)
            assert rc == 2 and err.startswith(f"error: --listen {listen!r}"), err
            assert len(err.strip().splitlines()) == 1, err


def test_serve_on_a_port_in_use_and_a_catalog_already_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tally
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with tally.bad_input("serve:port-in-use"):
            rc, err = _serve(capsys, "--root", str(root), "--listen", f"127.0.0.1:{port}")
            assert rc == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err
    finally:
        busy.close()
    first = Serve(tmp_path / "fresh", tmp_path / "serve").start()  # --create-root
    try:
        with tally.bad_input("serve:catalog-held"):
            rc, err = _serve(capsys, "--root", str(tmp_path / "fresh"), "--listen", "127.0.0.1:0")
            assert rc == 1 and "already open in another process" in err, err
            assert first.proc is not None and f"pid {first.proc.pid}" in err, err
    finally:
        assert first.proc is not None
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    # The killed server's lock went with it: a new one serves the root at once.
    second = Serve(tmp_path / "fresh", tmp_path / "serve2").start()
    try:
        wait_for(lambda: second.port is not None, 10, "the second server")
    finally:
        second.stop()
