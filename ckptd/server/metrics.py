"""Prometheus metrics of the coordinator, served over HTTP by `ckptd serve --metrics-port`.

A `Metrics` is a SaveObserver the core calls at a few points of each save, over its own
CollectorRegistry (not the process-global one) so several servers can live in one process
(tests, the embedded coordinator). The staging/persist/write/verify timings are the ranks'
own, carried in ReportShard; the commit time is the coordinator's (last report to durable
commit). Throughput is one histogram observation per rank and save, never a label per rank:
a 4,096-rank job must not create 4,096 series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ckptd.coordinator import observer as obs

if TYPE_CHECKING:
    from ckptd.coordinator.core import Coordinator
    from ckptd.coordinator.types import ShardReport

# Seconds: from a tiny test save to a multi-TB one on a slow filesystem.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# Bytes per second of one rank: 10 MB/s (a struggling NFS) to 50 GB/s (local NVMe arrays).
THROUGHPUT_BUCKETS = tuple(x * 1e6 for x in (10, 50, 100, 250, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4))
PHASES = ("staging", "persist", "write", "verify", "commit")


class Metrics(obs.SaveObserver):
    """The coordinator's metrics; `attach(core)` makes the core report to it."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.saves = Counter(
            "ckptd_saves",
            "Saves that ended, by outcome: committed; aborted (a rank, lease, barrier timeout "
            "or newer generation); failed (the coordinator's checks or the commit failed).",
            ["status"],
            registry=r,
        )
        for status in (obs.COMMITTED, obs.ABORTED, obs.FAILED):
            self.saves.labels(status)  # export zeros so rate() and alerts work from the start
        self.committed_bytes = Counter(
            "ckptd_committed_bytes", "Bytes in the shards of committed checkpoints.", registry=r
        )
        self.phase_seconds = Histogram(
            "ckptd_save_phase_seconds",
            "Duration of a save's phases: staging, persist, write, verify per rank (as the ranks "
            "report them); commit per save (last shard reported to durable commit).",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        self.rank_throughput = Histogram(
            "ckptd_rank_write_throughput_bytes_per_second",
            "Per rank and save: shard bytes / (write + verify seconds).",
            buckets=THROUGHPUT_BUCKETS,
            registry=r,
        )
        self.shard_bytes = Counter(
            "ckptd_reported_shard_bytes", "Bytes in shards reported by ranks.", registry=r
        )
        self.verification_failures = Counter(
            "ckptd_verification_failures",
            "Shards that failed a check: where=report (the coordinator's check of a reported "
            "shard) or load (a committed step found corrupt when loaded, then quarantined).",
            ["where"],
            registry=r,
        )
        for where in ("report", "load"):
            self.verification_failures.labels(where)
        self.open_sessions = Gauge(
            "ckptd_open_sessions", "Saves in progress (OPEN or COMMITTING).", registry=r
        )
        self.scan_skipped = Gauge(
            "ckptd_scan_skipped",
            "Jobs, steps or directories the coordinator's last scan of its root (a start-up "
            "with a new catalog) could not read and left out; each is logged with its path.",
            registry=r,
        )

    def attach(self, core: Coordinator) -> Metrics:
        core.observer = self
        # Read at scrape time (from the HTTP thread): len() of a dict is atomic.
        self.open_sessions.set_function(lambda: len(core.sessions))
        self.scan_skipped.set_function(lambda: core.skipped_count)
        return self

    # -- SaveObserver ----------------------------------------------------------------------
    def shard_reported(self, job: str, step: int, rank: int, report: ShardReport) -> None:
        self.shard_bytes.inc(report.size)
        for phase, seconds in (
            ("staging", report.staging_s),
            ("persist", report.persist_s),
            ("write", report.write_s),
            ("verify", report.verify_s),
        ):
            if seconds > 0:  # 0: a client that predates the timing fields
                self.phase_seconds.labels(phase).observe(seconds)
        io_s = report.write_s + report.verify_s
        if io_s > 0 and report.size:
            self.rank_throughput.observe(report.size / io_s)

    def verification_failed(self, job: str, step: int, where: str, reason: str) -> None:
        self.verification_failures.labels(where).inc()

    def save_ended(
        self, job: str, step: int, outcome: str, *, bytes: int = 0, commit_s: float = 0.0
    ) -> None:
        self.saves.labels(outcome).inc()
        if outcome == obs.COMMITTED:
            self.committed_bytes.inc(bytes)
            self.phase_seconds.labels("commit").observe(commit_s)


class MetricsServer:
    """The /metrics HTTP endpoint on a daemon thread (prometheus_client's own server)."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 0):  # noqa: S104
        self._httpd: Any
        self._httpd, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.host = host
        self.port = int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # noqa: S104
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
