"""Prometheus metrics: real saves over gRPC, then a scrape of the real HTTP endpoint.

The exposition text is parsed with prometheus_client's own parser, so a renamed metric
or a broken label fails here rather than in someone's dashboard.
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.request
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import TOKEN, RankSim, ServerThread, finished, serving
from prometheus_client.parser import text_string_to_metric_families

import ckpt
from ckptd.coordinator.types import SaveRef, ShardReport
from ckptd.server import ServerOptions
from ckptd.server.client import CoordinatorClient
from ckptd.server.metrics import Metrics, MetricsServer

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a real HTTP GET of the endpoint."""
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - a local test server
        assert r.status == 200
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted({k[0] for k in samples})}"
    return samples[key]


@pytest.fixture
def served(tmp_path: Path):
    s = ServerThread(tmp_path / "root", options=ServerOptions(token=TOKEN))
    metrics = Metrics().attach(s.core)
    http = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        yield s, http
    finally:
        http.close()
        s.stop()


def test_metrics_after_real_saves(served, tmp_path: Path) -> None:
    server, http = served
    before = scrape(http.url)
    assert value(before, "ckptd_saves_total", status="committed") == 0
    assert value(before, "ckptd_open_sessions") == 0

    job = str(tmp_path / "root" / "job")
    w = torch.arange(1 << 16, dtype=torch.float32)
    with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a") as cp:
        results = [finished(cp.save({"w": w + step}, step)) for step in (1, 2)]
    shard_bytes = sum(r.bytes for r in results)

    # A save one rank gave up on (over gRPC), and a committed step a load found corrupt.
    c = CoordinatorClient(server.address, token=TOKEN, retry_for_s=1)
    try:
        c.abort_save(SaveRef(job, 3, 0, 0, 1), "rank 0 ran out of memory")
        c.quarantine(job, 1, "rank 0: key 'w' block 0 hash mismatch")
    finally:
        c.close()
    # A rank reporting a shard of the wrong size: the coordinator's check fails the save.
    bad = RankSim(server.core, job, 0, 1)
    bad.prepare({"x": torch.ones(1000)})
    server.call(bad.begin(4))
    rep = bad.write_blocking(4)
    st = server.call(bad.report(4, dataclasses.replace(rep, size=rep.size + 1)))
    assert st.status == "ABORTED" and "the rank reported" in st.reason, st.reason
    # A save still open (one part of two sent): counted as an open session.
    part = RankSim(server.core, job, 0, 1)
    part.prepare({"y": torch.ones(10)})
    server.call(part.begin(5, part=0, parts=2))

    got = scrape(http.url)
    assert value(got, "ckptd_saves_total", status="committed") == 2
    assert value(got, "ckptd_saves_total", status="aborted") == 1
    assert value(got, "ckptd_saves_total", status="failed") == 1
    assert value(got, "ckptd_committed_bytes_total") == shard_bytes
    assert value(got, "ckptd_verification_failures_total", where="report") == 1
    assert value(got, "ckptd_verification_failures_total", where="load") == 1
    assert value(got, "ckptd_open_sessions") == 1
    # The ranks' own timings arrived through ReportShard: one observation per rank and save.
    for phase in ("staging", "persist", "write", "verify"):
        assert value(got, "ckptd_save_phase_seconds_count", phase=phase) == 2, phase
        assert value(got, "ckptd_save_phase_seconds_sum", phase=phase) > 0, phase
    assert value(got, "ckptd_save_phase_seconds_count", phase="commit") == 2
    assert value(got, "ckptd_rank_write_throughput_bytes_per_second_count") == 2
    assert value(got, "ckptd_rank_write_throughput_bytes_per_second_sum") > 0
    # No per-rank label anywhere (a big job must not explode the series count).
    assert not any("rank" in dict(labels) for _, labels in got)


def test_two_servers_in_one_process_have_separate_registries(tmp_path: Path) -> None:
    a, b = Metrics(), Metrics()
    a.save_ended("job", 1, "committed", bytes=10)
    assert a.registry is not b.registry
    assert a.registry.get_sample_value("ckptd_saves_total", {"status": "committed"}) == 1
    assert b.registry.get_sample_value("ckptd_saves_total", {"status": "committed"}) == 0


def test_a_client_without_timings_observes_no_phases() -> None:
    """Clients that predate ReportShard's timing fields send zeros: counted, not timed."""
    m = Metrics()
    m.shard_reported("job", 1, 0, ShardReport("s.bin", 4096, "s.json", 10, "0" * 64))
    get = m.registry.get_sample_value
    assert get("ckptd_reported_shard_bytes_total") == 4096
    assert get("ckptd_save_phase_seconds_count", {"phase": "write"}) == 0
    assert get("ckptd_rank_write_throughput_bytes_per_second_count") == 0


def test_ckptd_serve_metrics_port_zero(tmp_path: Path) -> None:
    """`ckptd serve --metrics-port 0` picks a port, writes it, and serves a real save's metrics."""
    port_file = tmp_path / "srv" / "metrics-port"
    with serving(
        tmp_path / "root",
        tmp_path / "srv",
        extra_args=["--metrics-port", "0", "--metrics-port-file", str(port_file)],
    ) as s:
        s.start()
        port = int(port_file.read_text())
        assert port > 0 and port != s.port
        assert f"metrics on 127.0.0.1:{port}" in s.log()
        job = str(tmp_path / "root" / "job")
        with ckpt.Checkpointer(job, coordinator=s.address, token=TOKEN, attempt="a") as cp:
            r = finished(cp.save({"w": torch.ones(256)}, 7))
        got = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(got, "ckptd_saves_total", status="committed") == 1
        shards = (Path(job) / "step-000000000007" / "shards").glob("*.bin")
        assert value(got, "ckptd_committed_bytes_total") == sum(f.stat().st_size for f in shards)
        assert r.bytes == 1024


def test_save_result_timings_and_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The client reports the same phases in SaveResult and one INFO line per save."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.DEBUG, logger="ckpt"):
        with ckpt.Checkpointer(str(tmp_path / "job")) as cp:
            r = finished(cp.save({"w": w}, 3))
        single = ckpt.save({"w": w}, str(tmp_path / "single"), step=1)
    assert r.bytes >= w.numel() * 4
    for field in ("staging_s", "persist_s", "write_s", "verify_s", "commit_s", "blocking_s"):
        assert getattr(r, field) > 0, field
    assert r.persist_s >= r.write_s + r.verify_s
    assert single.persist_s > 0 and single.commit_s > 0 and single.write_s > 0
    infos = [
        m.getMessage() for m in caplog.records if m.levelno == logging.INFO and m.name == "ckpt"
    ]
    saved = [m for m in infos if "committed" in m and "staging" in m]
    assert len(saved) == 2, infos
    assert "step 3 rank 0/1" in saved[0] and "persist" in saved[0] and "commit" in saved[0]
    assert "step 1" in saved[1]
    debug = [m.getMessage() for m in caplog.records if m.levelno == logging.DEBUG]
    assert any("planned" in m and "barrier" in m for m in debug), debug
    assert any("written" in m and "verify" in m for m in debug), debug


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_embedded_coordinator_metrics_during_a_torchrun_job(tmp_path: Path) -> None:
    """CKPTD_METRICS_PORT=0: the zero-config coordinator of a 2-rank torchrun job (hosted by
    rank 0) serves the same metrics as `ckptd serve`, scraped while the job runs."""
    import subprocess
    import sys

    from coordinator_fixtures import REPO, child_env, wait_for

    job, go, port_file = tmp_path / "job", tmp_path / "go", tmp_path / "metrics-port"
    log = tmp_path / "torchrun.log"
    env = child_env(CKPTD_METRICS_PORT="0", CKPTD_METRICS_PORT_FILE=str(port_file))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "0", str(REPO / "tests" / "ranks" / "metrics_worker.py"),
           str(job), str(go)]  # fmt: skip
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_for(lambda: port_file.exists() or p.poll() is not None, 90, "the metrics port file")
        assert p.poll() is None, log.read_text(errors="replace")
        url = f"http://127.0.0.1:{int(port_file.read_text())}/metrics"
        got = wait_for(
            lambda: (
                (s := scrape(url)) and value(s, "ckptd_saves_total", status="committed") == 2 and s
            ),
            90,
            "two committed saves in the embedded coordinator's metrics",
        )
        # both ranks' shards of both saves, the ranks' own timings, nothing open
        assert value(got, "ckptd_save_phase_seconds_count", phase="write") == 4
        assert value(got, "ckptd_save_phase_seconds_count", phase="commit") == 2
        assert value(got, "ckptd_saves_total", status="aborted") == 0
        assert value(got, "ckptd_open_sessions") == 0
        shards = [f for s in (1, 2) for f in (job / f"step-{s:012d}" / "shards").glob("*.bin")]
        assert len(shards) == 4
        assert value(got, "ckptd_committed_bytes_total") == sum(f.stat().st_size for f in shards)
        go.write_text("")
        assert p.wait(timeout=90) == 0, log.read_text(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (job / "step-000000000003" / "MANIFEST.json").exists()
