"""Fixtures: a job directory per test and ways to run ckptctl (subprocess and in-process)."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent

# Property tests stay small: the default run must fit a 2-core CI box.
_quiet = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much]
settings.register_profile("ckptd", max_examples=40, deadline=None, suppress_health_check=_quiet)
# HYPOTHESIS_PROFILE=thorough for a longer hunt (not part of the default run).
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=_quiet
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ckptd"))

CkptctlRunner = Callable[..., tuple[int, str, str]]


@pytest.fixture(autouse=True, scope="module")
def _collect_what_the_module_left() -> object:
    """Collects garbage after each test module, so that an event loop, socket or process a
    module left open warns (an error, by filterwarnings) in that module's last test, not in
    whichever later test the collector happens to run in, or after the session."""
    yield
    gc.collect()


def _ckptctl_available() -> bool:
    try:
        return importlib.util.find_spec("ckptd.cli.ckptctl") is not None
    except ImportError:
        return False


def _memory_url() -> Iterator[str]:
    import fsspec

    name = f"ckptd-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    mem = fsspec.filesystem("memory")
    if mem.exists(f"/{name}"):
        mem.rm(f"/{name}", recursive=True)


@pytest.fixture
def mem_url() -> Iterator[str]:
    """A fresh memory:// URL (fsspec's in-process store), emptied after the test."""
    yield from _memory_url()


@pytest.fixture
def mem_job() -> Iterator[str]:
    """A job's directory in fsspec's memory store (a fresh URL, emptied after)."""
    yield from _memory_url()


@pytest.fixture
def mem_mirror() -> Iterator[str]:
    """A job's mirror tier in fsspec's memory store (a fresh URL, emptied after)."""
    yield from _memory_url()


@pytest.fixture
def job(tmp_path: Path) -> str:
    """A job's checkpoint directory (not created: ckpt.save creates it)."""
    return str(tmp_path / "job")


@pytest.fixture
def run_ckptctl() -> CkptctlRunner:
    """Run `python -m ckptd.cli.ckptctl ARGS...` in a subprocess: (returncode, stdout, stderr)."""
    if not _ckptctl_available():
        pytest.skip("ckptd.cli.ckptctl is not there yet")

    def run(*args: str, timeout: float = 120) -> tuple[int, str, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptd.cli.ckptctl", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
        return proc.returncode, proc.stdout, proc.stderr

    return run


@pytest.fixture
def ckptctl() -> CkptctlRunner:
    """ckptctl's main(argv) in this process (fast): (exit code, stdout, stderr).

    The subprocess runner above covers the real entry point; this one lets the
    corruption matrix run ckptctl many times without paying a torch import each time.
    """
    if not _ckptctl_available():
        pytest.skip("ckptd.cli.ckptctl is not there yet")
    from ckptd.cli import ckptctl as cli

    def run(*args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse may exit instead of returning
                rc = e.code if isinstance(e.code, int) else 2
        return rc, out.getvalue(), err.getvalue()

    return run


@pytest.fixture
def tally(request: pytest.FixtureRequest):  # noqa: ANN201 - tests/tally.py's Tally
    """Counts injected faults and bad inputs for bench/reliability_report.py."""
    from tally import Tally

    return Tally(request.node.nodeid)
