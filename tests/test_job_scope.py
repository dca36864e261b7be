"""A coordinator stays inside its job (issue 14, part 3; promise 6).

On main before the change, `Checkpointer("<parent>/job")` rebuilt its new catalog from
every directory below `<parent>`: the jobs beside it were filed into its catalog, and one
of them holding a step that was a symlink out of itself made the constructor raise
`UnsafePath` about that other job. `ckptd serve --root` stopped at start-up on the same
link. Now the embedded coordinator reads its own job alone, and the service's scan reports
and skips what it cannot read.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import TOKEN, child_env, serving

import ckpt
from ckptd.coordinator import recovery
from ckptd.errors import UnsafePath

STEP1 = "step-000000000001"


def _hostile(parent: Path, kind: str, outside: Path) -> Path:
    """A job directory beside the user's that holds a hostile step."""
    other = parent / f"other-{kind}"
    other.mkdir(parents=True)
    if kind == "link-out":  # a real committed step, elsewhere, linked in
        ckpt.save({"w": torch.ones(2)}, str(outside / "job"), step=1)
        os.symlink(outside / "job" / STEP1, other / STEP1)
    else:  # a symlink loop named as a step, and one as a plain directory
        os.symlink(other / STEP1, other / STEP1)
        os.symlink(parent, other / "up")
    return other


@pytest.mark.parametrize("kind", ["link-out", "loop"])
def test_a_hostile_sibling_does_not_stop_a_checkpointer(tmp_path: Path, kind: str, tally) -> None:
    parent = tmp_path / "ckpts"
    _hostile(parent, kind, tmp_path / "outside")
    job = str(parent / "job")
    with tally.fault(f"a sibling job with a {kind} symlink"):
        with ckpt.Checkpointer(job) as cp:
            cp.save({"w": torch.arange(4.0)}, 1, blocking=True)
            steps = [r.step for r in cp.client.list_checkpoints(cp.path)]
        target = {"w": torch.zeros(4)}
        with ckpt.Checkpointer(job) as cp:
            assert cp.load(target).step == 1
    assert steps == [1]
    assert torch.equal(target["w"], torch.arange(4.0))


def _copies(template: Path, parent: Path, n: int) -> list[Path]:
    """n committed jobs beside each other: copies of one saved job (its catalog left out)."""
    out = []
    for i in range(n):
        dst = parent / f"sibling-{i:03d}"
        shutil.copytree(template, dst, ignore=shutil.ignore_patterns(".ckptd"), symlinks=True)
        out.append(dst)
    return out


# The child records every directory listing and file open below the siblings (Python's audit
# events: os.scandir, os.listdir, open) while it starts a Checkpointer and saves.
_AUDIT = textwrap.dedent(
    """
    import json, os, sys
    import torch, ckpt

    parent, job, out = sys.argv[1:4]
    touched = []

    def hook(event, args):
        if event in ("os.scandir", "os.listdir", "open") and args and args[0] is not None:
            p = args[0]
            if isinstance(p, (str, bytes, os.PathLike)):
                p = os.fsdecode(p)
                if p.startswith(os.path.join(parent, "sibling-")):
                    touched.append(f"{event} {p}")

    sys.addaudithook(hook)
    with ckpt.Checkpointer(job) as cp:
        cp.save({"w": torch.ones(3)}, 1, blocking=True)
    with open(out, "w") as f:
        json.dump(touched, f)
    """
)


@pytest.mark.timeout(240)
def test_the_embedded_catalog_holds_its_own_job_alone_with_40_siblings(tmp_path: Path) -> None:
    parent = tmp_path / "ckpts"
    template = tmp_path / "template"
    with ckpt.Checkpointer(str(template)) as cp:
        for step in (1, 2, 3):
            cp.save({"w": torch.full((3,), float(step))}, step, blocking=True)
    siblings = _copies(template, parent, 40)
    job = parent / "job"
    out = tmp_path / "touched.json"
    subprocess.run(
        [sys.executable, "-c", _AUDIT, str(parent), str(job), str(out)],
        env=child_env(),
        check=True,
        timeout=200,
    )
    assert json.loads(out.read_text()) == []  # never listed or opened a sibling
    with sqlite3.connect(job / ".ckptd" / "catalog.sqlite") as db:
        rows = db.execute("SELECT job, step FROM saves ORDER BY job, step").fetchall()
        jobs = [j for (j,) in db.execute("SELECT job FROM jobs")]
    assert rows == [("job", 1)]
    assert jobs == ["job"]
    # It refuses to serve a sibling (its catalog is the job's own); the sibling is intact.
    with ckpt.Checkpointer(str(job)) as cp:
        with pytest.raises(UnsafePath, match="serves that job alone"):
            cp.client.list_checkpoints(str(siblings[0]))
    assert ckpt.load({}, str(siblings[0])).step == 3


def test_ckptd_serve_reports_and_skips_hostile_jobs_and_serves_the_rest(
    tmp_path: Path, tally
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    _hostile(root, "link-out", outside)
    _hostile(root, "loop", outside)
    os.symlink(outside, root / "linked-out")  # a job directory that is a link out
    ckpt.save({"w": torch.ones(2)}, str(root / "good"), step=5)
    bad = root / "corrupt"
    ckpt.save({"w": torch.ones(2)}, str(bad), step=1)
    (bad / STEP1 / "MANIFEST.json").write_bytes(b'{"format": "not a manifest')
    many = root / "many"
    for i in range(10_000):
        (many / f"step-{i:012d}").mkdir(parents=True)
    for p in (root / "good" / ".ckptd", bad / ".ckptd"):
        shutil.rmtree(p)  # no catalog: serve's start-up scans the root
    metrics_file = tmp_path / "srv" / "metrics-port"
    with (
        tally.fault("ckptd serve over a root with hostile jobs"),
        serving(
            root,
            tmp_path / "srv",
            extra_args=["--metrics-port", "0", "--metrics-port-file", str(metrics_file)],
        ) as s,
    ):
        t0 = time.monotonic()
        s.start(timeout=120)
        started_s = time.monotonic() - t0
        fresh = str(root / "fresh")
        with ckpt.Checkpointer(fresh, coordinator=s.address, token=TOKEN, attempt="a") as cp:
            cp.save({"w": torch.arange(3.0)}, 1, blocking=True)
            assert [r.step for r in cp.client.list_checkpoints(fresh)] == [1]
            assert [r.step for r in cp.client.list_checkpoints(str(root / "good"))] == [5]
        metrics = _scrape(int(metrics_file.read_text()))
        log = s.log()
    assert torch.equal(ckpt.load({}, fresh).state["w"], torch.arange(3.0))
    for path, why in (
        (root / "other-link-out" / STEP1, "passes through a symlink"),
        (root / "other-loop" / STEP1, "is a symlink loop"),
        (root / "linked-out", "outside the root; ckptd does not follow it"),
        (bad / STEP1, "not valid JSON"),
    ):
        lines = [line for line in log.splitlines() if f"skipped {path}: " in line]
        assert len(lines) == 1 and why in lines[0], log
    assert "ckptd_scan_skipped 4.0" in metrics, metrics
    assert started_s < 60, started_s


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:  # noqa: S310
        return str(r.read().decode())


def test_the_scan_is_bounded_and_reports_where_it_stopped(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"d{i:02d}" / "x" / STEP1).mkdir(parents=True)
    got: list[tuple[str, str]] = []
    jobs = recovery._find_jobs(str(tmp_path), lambda p, r, a: got.append((p, r)), max_dirs=10)
    assert len(jobs) < 30
    assert got == [(str(tmp_path), got[0][1])] and "stopped after listing 10" in got[0][1]
    assert len(recovery._find_jobs(str(tmp_path), lambda *a: None)) == 30


def _without_dac_override() -> None:
    """In the child before exec: drop root's power to read past permissions (the bounding
    set's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so a chmod 000 directory is unreadable
    to it as to anyone."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(97)


def test_an_unreadable_job_is_reported_and_skipped(tmp_path: Path, tally) -> None:
    """`ckptd rebuild-catalog` (the same scan as serve's start-up) over a root holding a
    directory it may not read; as root, run without the capabilities that read past it."""
    root = tmp_path / "root"
    ckpt.save({"w": torch.ones(2)}, str(root / "good"), step=2)
    ckpt.save({"w": torch.ones(2)}, str(root / "secret"), step=1)
    (root / "secret").chmod(0)
    try:
        with tally.bad_input("an unreadable job directory under the root"):
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ckptd.cli.serve",
                    "rebuild-catalog",
                    "--root",
                    str(root),
                    "--catalog",
                    str(tmp_path / "catalog.sqlite"),
                ],
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=120,
                preexec_fn=_without_dac_override if os.geteuid() == 0 else None,  # noqa: PLW1509
            )
    finally:
        (root / "secret").chmod(0o755)
    assert r.returncode == 0, r.stderr
    assert "1 committed checkpoint(s)" in r.stdout, r.stdout
    assert f"skipped {root / 'secret'}: cannot be listed (Permission denied)" in r.stdout
