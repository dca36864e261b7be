"""A standby coordinator taking over: how long until it leads, and until a save that was
in flight when the leader died has finished (committed) or aborted.

A real PostgreSQL (started here as tests/pg_server.py starts it) and, for each rep of each
case, two fresh `ckptd serve` processes on one catalog database: A leads, B stands by. A
client in this process (a `ckpt.Checkpointer` of one rank, `coordinator="B,A"`: the
standby first, as a client that knows both addresses in any order) saves `--mib` MiB:

- between saves: step 1 commits, A is SIGKILLed, step 2 starts at once;
- mid-commit: A dies by CKPT_CRASH_AT=coordinator.mid_manifest while committing step 2
  (every shard reported: B commits it);
- in flight: A dies at coordinator.after_barrier (planned, nothing reported: B aborts it).

Times are from A's death (the moment waitpid returns it): "lock" when B logs that it
leads (PostgreSQL granted the lock), "serving" when B serves on its address (schema and
recovery done), "save ended" when the client's save returned (committed, or raised
SaveAborted); the floor is the same client's save of the same state with no failover, in
the same rep. Log times have millisecond resolution.

    .venv/bin/python bench/standby.py --reps 5 --mib 16
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import ckpt
from ckptd.errors import SaveAborted

BENCH_DIR = Path(__file__).resolve().parent
# The tests' PostgreSQL starter (initdb in a temporary directory, an unprivileged user
# under root): one way to start it, not a copy.
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
import _common as C  # noqa: E402
from pg_server import PgServer, pg_bin  # noqa: E402

TOKEN = "bench-standby-token"
CKPTD = str(Path(sys.executable).with_name("ckptd"))


class Serve:
    def __init__(self, work: Path, name: str, root: Path, url: str, env: dict[str, str]):
        self.log = work / f"{name}.log"
        port_file = work / f"{name}.port"
        token = work / "token"
        token.write_text(TOKEN + "\n")
        cmd = [
            CKPTD, "serve", "--root", str(root), "--create-root", "--listen", "127.0.0.1:0",
            "--token-file", str(token), "--catalog", url, "--port-file", str(port_file),
            "--lease", "30",
        ]  # fmt: skip
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )
        self.died_at: float | None = None
        threading.Thread(target=self._reap, daemon=True).start()
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"

    def _reap(self) -> None:
        self.proc.wait()
        self.died_at = time.time()

    def logged_at(self, text: str, timeout: float = 60) -> float:
        """The time of the first log line containing `text` (its asctime)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if text in line and line[:4].isdigit():
                    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                    return stamp.timestamp()
            time.sleep(0.02)
        raise RuntimeError(f"no {text!r} in {self.log}:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def state(mib: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * (1 << 18), generator=g), "step": seed}


def one(pg: PgServer, work: Path, case: str, mib: int, rep: int) -> dict[str, float]:
    url = pg.create_database()
    root = work / f"root-{case}-{rep}"
    crash = {"mid-commit": "coordinator.mid_manifest", "in flight": "coordinator.after_barrier"}
    a = Serve(work, f"a-{case}-{rep}", root, url, {"CKPT_CRASH_AT": crash.get(case, "")})
    a.logged_at("ckptd serving")
    b = Serve(work, f"b-{case}-{rep}", root, url, {})
    try:
        cp = ckpt.Checkpointer(
            str(root / "job"), coordinator=f"{b.address},{a.address}", token=TOKEN,
            attempt=f"{case}-{rep}", verify="size",
        )  # fmt: skip
        outcome = "committed"
        try:
            floor_t0 = time.time()
            if case == "between saves":
                cp.save(state(mib, 1), 1).wait()
                floor = time.time() - floor_t0
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait()
                cp.save(state(mib, 2), 2).wait()
            else:
                floor = float("nan")  # A dies during its first save: measured apart below
                try:
                    cp.save(state(mib, 2), 2).wait()
                except SaveAborted:
                    outcome = "aborted"
            ended = time.time()
        finally:
            cp.close()
        while a.died_at is None:
            time.sleep(0.01)
        died = a.died_at
        out = {
            "lock_s": b.logged_at("leading on the catalog") - died,
            "serving_s": b.logged_at("ckptd serving") - died,
            "save_ended_s": ended - died,
            "floor_s": floor,
            "outcome": outcome,
        }
    finally:
        a.stop()
        b.stop()
    if case != "between saves":
        out["floor_s"] = floor_save(pg, work, mib, f"{case}-{rep}")
    return out


def floor_save(pg: PgServer, work: Path, mib: int, name: str) -> float:
    """A save of the same state through the same pair, nothing killed."""
    url = pg.create_database()
    root = work / f"root-floor-{name}"
    a = Serve(work, f"a-floor-{name}", root, url, {})
    a.logged_at("ckptd serving")
    b = Serve(work, f"b-floor-{name}", root, url, {})
    try:
        with ckpt.Checkpointer(
            str(root / "job"), coordinator=f"{b.address},{a.address}", token=TOKEN,
            attempt=f"floor-{name}", verify="size",
        ) as cp:  # fmt: skip
            t0 = time.time()
            cp.save(state(mib, 2), 2).wait()
            return time.time() - t0
    finally:
        a.stop()
        b.stop()


def med(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mib", type=int, default=16)
    args = p.parse_args()
    bindir = pg_bin()
    if bindir is None:
        sys.exit("PostgreSQL is not installed: apt-get install postgresql")
    load = C.loadavg_at_start()
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-standby-"))
    pg = PgServer(bindir).start()
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        for rep in range(args.reps):
            for case in ("between saves", "mid-commit", "in flight"):
                r = one(pg, work, case, args.mib, rep)
                rows.setdefault(case, []).append(r)
                print(f"rep {rep} {case}: {r}", flush=True)
    finally:
        pg.stop()
    print(f"\n{args.reps} reps, {args.mib} MiB, load average at start {load}; median (min-max) s")
    print(
        "| A died ... | B has the lock | B serving | the save ended | outcome | save, no failover |"
    )
    print("|---|---|---|---|---|---|")
    for case, rs in rows.items():
        outcomes = sorted({str(r["outcome"]) for r in rs})
        print(
            f"| {case} | {med([r['lock_s'] for r in rs])} | {med([r['serving_s'] for r in rs])} "
            f"| {med([r['save_ended_s'] for r in rs])} | {'/'.join(outcomes)} "
            f"| {med([r['floor_s'] for r in rs])} |"
        )
    path = C.write_results(
        "standby",
        {"args": vars(args), "load": load, "machine": C.machine_info(work), "rows": rows},
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
