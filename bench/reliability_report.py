"""The reliability suite's figures in one table: faults injected / survived, bad inputs tried
/ answered with a clear error, load held / lost, and the pytest counts behind them.

Runs pytest on the suite's test files with $CKPT_TALLY_FILE set; each test counts what it
injects through the `tally` fixture (tests/tally.py: one JSON line per fault, bad input or
load run), and this script sums the lines. A listed file that does not exist (yet) is
skipped with a note. Exit status 1 when anything injected was not survived, a bad input
did not get a clear error, a load run lost a report or committed a save it must not have,
or a test failed; the table and the raw counts go to bench/results/reliability-<ts>.json.

    .venv/bin/python bench/reliability_report.py                # the default (quick) run
    .venv/bin/python bench/reliability_report.py --slow         # + the slow tests (-m "")
    .venv/bin/python bench/reliability_report.py --slow --soak-n 200 --hypothesis-profile thorough
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
# The suite's counting parts (globs, relative to the repository).
SUITE = [
    "tests/test_crash_points.py",
    "tests/test_power_loss.py",
    "tests/test_io_errors.py",
    "tests/test_kill_soak.py",
    "tests/test_fuzz_*.py",
    "tests/test_*_fuzz.py",
    "tests/test_auth_matrix.py",
    "tests/test_tamper*.py",
    "tests/test_parse_limits.py",
    "tests/test_path_confinement.py",
    "tests/test_manifest_parsing.py",
    "tests/test_corruption.py",
    "tests/test_coordinator_faults.py",
    "tests/test_coordinator_server.py",
    "tests/test_load_soak.py",
    # issue 13: what users do (failing fast, job edges, the CLI as documented, exports,
    # what a load restores)
    "tests/test_fail_fast.py",
    "tests/test_job_edges.py",
    "tests/test_ckptctl.py",
    "tests/test_cli_doc_walk.py",
    "tests/test_export.py",
    "tests/test_load_fidelity.py",
]
LOAD_FAILURES = ("lost", "wrongly_committed", "unexpected_aborts")


def suite_files(patterns: Iterable[str]) -> tuple[list[str], list[str]]:
    """(files found, patterns that matched nothing), each file once, in the given order."""
    found: list[str] = []
    missing: list[str] = []
    for pat in patterns:
        if os.path.isabs(pat):
            hits = sorted(glob.glob(pat))
        else:
            hits = sorted(str(p.relative_to(REPO)) for p in REPO.glob(pat))
        if not hits:
            missing.append(pat)
        found += [h for h in hits if h not in found]
    return found, missing


def read_records(path: Path) -> list[dict[str, Any]]:
    """The tally's JSON lines; a torn or foreign line is skipped, not fatal."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("table") in ("fault", "bad_input", "load"):
            out.append(rec)
    return out


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Counts by table and kind: {"fault": {kind: {"tried", "held"}}, "bad_input": ...,
    "load": [each load record's figures, with "failed"]}, and the totals."""
    out: dict[str, Any] = {"fault": {}, "bad_input": {}, "load": []}
    for rec in records:
        table, kind = rec["table"], str(rec.get("kind", "?"))
        if table == "load":
            figures = {k: v for k, v in rec.items() if k not in ("table", "ok")}
            figures["failed"] = sum(int(rec.get(k) or 0) for k in LOAD_FAILURES)
            out["load"].append(figures)
            continue
        c = out[table].setdefault(kind, {"tried": 0, "held": 0})
        c["tried"] += 1
        c["held"] += 1 if rec.get("ok") is True else 0
    for table in ("fault", "bad_input"):
        out[table] = dict(sorted(out[table].items()))
        out[f"{table}_total"] = {
            "tried": sum(c["tried"] for c in out[table].values()),
            "held": sum(c["held"] for c in out[table].values()),
        }
    return out


def failures(summary: dict[str, Any], pytest_counts: dict[str, Any] | None = None) -> list[str]:
    """What was not held, in words; empty when everything was."""
    bad = []
    for table, what in (("fault", "not survived"), ("bad_input", "no clear error")):
        for kind, c in summary[table].items():
            if c["held"] < c["tried"]:
                bad.append(f"{table} {kind}: {c['tried'] - c['held']} of {c['tried']} {what}")
    for rec in summary["load"]:
        if rec["failed"]:
            parts = ", ".join(f"{k} {rec.get(k, 0)}" for k in LOAD_FAILURES)
            bad.append(f"load {rec.get('kind')} ({rec.get('test')}): {parts}")
    if pytest_counts and (pytest_counts["failed"] or pytest_counts["errors"]):
        bad.append(f"pytest: {pytest_counts['failed']} failed, {pytest_counts['errors']} errors")
    return bad


def _fmt(v: Any, unit: str = "") -> str:
    if isinstance(v, float):
        return f"{v:.0f}{unit}" if abs(v) >= 10 else f"{v:.1f}{unit}"
    return "?" if v is None else f"{v}{unit}"


def markdown(summary: dict[str, Any], pytest_counts: dict[str, Any] | None) -> str:
    """One table: what was tried, how much of it held, how much did not, and figures."""
    rows = ["| part | kind | tried | held | not held | figures |", "|---|---|---|---|---|---|"]
    for table, label, held in (
        ("fault", "fault injected", "survived"),
        ("bad_input", "bad input", "clear error"),
    ):
        for kind, c in summary[table].items():
            rows.append(
                f"| {label} | {kind} | {c['tried']} | {c['held']} {held} | {c['tried'] - c['held']} | |"
            )
        t = summary[f"{table}_total"]
        rows.append(
            f"| **{label}, all** | {len(summary[table])} kinds | **{t['tried']}** "
            f"| **{t['held']}** | **{t['tried'] - t['held']}** | |"
        )
    for rec in summary["load"]:
        test = str(rec.get("test", "")).rsplit("::", 1)[-1]
        tried = (
            f"{_fmt(rec.get('ranks'))} ranks, {_fmt(rec.get('saves'))} saves + "
            f"{_fmt(rec.get('aborted'))} aborted, {_fmt(rec.get('rpcs'))} RPCs"
        )
        held = (
            f"lost {_fmt(rec.get('lost'))}, wrongly committed {_fmt(rec.get('wrongly_committed'))}"
        )
        figures = (
            f"p99 {_fmt(rec.get('p99_ms'), ' ms')}, RSS {_fmt(rec.get('rss_mib_first'))} → "
            f"{_fmt(rec.get('rss_mib_last'))} MiB"
        )
        if rec.get("seconds") is not None:
            figures += f", {_fmt(rec.get('seconds'), ' s')}"
        rows.append(
            f"| load held | {rec.get('kind')} ({test}) | {tried} | {held} | {rec['failed']} | {figures} |"
        )
    if pytest_counts:
        p = pytest_counts
        rows.append(
            f"| pytest | {p['files']} files | {p['tests']} tests | {p['passed']} passed "
            f"| {p['failed'] + p['errors']} failed | {p['skipped']} skipped, "
            f"{p['wall_s']:.0f} s wall |"
        )
    return "\n".join(rows)


def junit_counts(path: Path) -> dict[str, int]:
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    if not path.exists():
        return counts
    root = ET.parse(path).getroot()  # our own pytest's output
    for suite in root.iter("testsuite"):
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0))
        counts["errors"] += int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
    return counts


def run_pytest(files: list[str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tally_file, junit = work / "tally.jsonl", work / "junit.xml"
    env = dict(os.environ)
    env["CKPT_TALLY_FILE"] = str(tally_file)
    pp = [str(REPO), str(REPO / "clients" / "python"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in pp if p)
    if args.soak_n:
        env["CKPT_SOAK_N"] = str(args.soak_n)
    if args.hypothesis_profile:
        env["HYPOTHESIS_PROFILE"] = args.hypothesis_profile
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"]
    cmd += ["--junitxml", str(junit)]
    if args.slow:
        cmd += ["-m", ""]  # every marker, the slow ones included
    cmd += args.pytest_args
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    wall = time.perf_counter() - t0
    counts = junit_counts(junit)
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    if rc not in (0, 1) and not counts["failed"] and not counts["errors"]:
        counts["errors"] += 1  # pytest itself failed (usage error, collection, interrupted)
    return {
        **counts,
        "files": len(files),
        "returncode": rc,
        "wall_s": wall,
        "records": read_records(tally_file),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--slow", action="store_true", help='include slow tests (pytest -m "")')
    p.add_argument("--soak-n", type=int, default=0, help="CKPT_SOAK_N for the kill soak")
    p.add_argument("--hypothesis-profile", default="", help="HYPOTHESIS_PROFILE (e.g. thorough)")
    p.add_argument("--files", nargs="*", help="test files/globs instead of the suite's list")
    p.add_argument("--no-results", action="store_true", help="do not write the JSON file")
    p.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest")
    args = p.parse_args(argv)
    files, missing = suite_files(args.files or SUITE)
    for pat in missing:
        print(f"note: {pat}: no such test file here; skipped", flush=True)
    if not files:
        print("no test files to run", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        run = run_pytest(files, args, Path(tmp))
    records = run.pop("records")
    summary = summarize(records)
    table = markdown(summary, run)
    bad = failures(summary, run)
    print("\n" + table + "\n")
    for b in bad:
        print(f"NOT HELD: {b}")
    print("all held" if not bad else f"{len(bad)} things not held")
    if not args.no_results:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = RESULTS_DIR / f"reliability-{stamp}.json"
        data = {
            "report": "reliability",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args),
            "files": files,
            "missing": missing,
            "pytest": run,
            "summary": summary,
            "not_held": bad,
            "table_markdown": table,
            "loadavg": os.getloadavg(),
            "records": records,
        }
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"results: {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
