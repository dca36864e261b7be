"""bench/reliability_report.py: summing the tally's JSON lines into one table, and the exit
status that says whether everything held (a real pytest run on two tiny generated files)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
rr = pytest.importorskip("reliability_report")

FAKE = [
    {"table": "fault", "kind": "crash:rank.mid_write", "ok": True, "test": "t::a"},
    {"table": "fault", "kind": "crash:rank.mid_write", "ok": True, "test": "t::a"},
    {"table": "fault", "kind": "io:eio-fsync", "ok": False, "test": "t::b"},
    {"table": "bad_input", "kind": "path:dotdot", "ok": True, "test": "t::c"},
    {"table": "bad_input", "kind": "manifest:bomb", "ok": True, "test": "t::d"},
    {
        "table": "load",
        "kind": "coordinator-load",
        "ok": True,
        "test": "tests/test_load_soak.py::test_load_soak_small",
        "ranks": 64,
        "saves": 6,
        "aborted": 2,
        "rpcs": 1508,
        "p99_ms": 54.7,
        "lost": 0,
        "wrongly_committed": 0,
        "rss_mib_first": 57.0,
        "rss_mib_last": 59.2,
    },
]


def test_summarize_counts_by_kind() -> None:
    s = rr.summarize(FAKE)
    assert s["fault"] == {
        "crash:rank.mid_write": {"tried": 2, "held": 2},
        "io:eio-fsync": {"tried": 1, "held": 0},
    }
    assert s["fault_total"] == {"tried": 3, "held": 2}
    assert s["bad_input_total"] == {"tried": 2, "held": 2}
    assert len(s["load"]) == 1 and s["load"][0]["failed"] == 0
    assert rr.failures(s) == ["fault io:eio-fsync: 1 of 1 not survived"]


def test_lost_reports_and_failed_tests_are_not_held() -> None:
    lost = dict(FAKE[-1], lost=3)
    s = rr.summarize([FAKE[0], lost])
    bad = rr.failures(s, {"failed": 1, "errors": 0})
    assert any("lost 3" in b for b in bad) and any("pytest: 1 failed" in b for b in bad)
    assert rr.failures(rr.summarize(FAKE[:2] + FAKE[3:])) == []


def test_markdown_is_one_table() -> None:
    counts = {"files": 3, "tests": 10, "passed": 9, "failed": 1, "errors": 0, "skipped": 0}
    md = rr.markdown(rr.summarize(FAKE), {**counts, "wall_s": 12.3})
    lines = md.splitlines()
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "| fault injected | io:eio-fsync | 1 | 0 survived | 1 |" in md
    assert "**fault injected, all** | 2 kinds | **3** | **2** | **1**" in md
    assert "64 ranks, 6 saves + 2 aborted, 1508 RPCs" in md
    assert "lost 0, wrongly committed 0" in md and "RSS 57 → 59 MiB" in md
    assert "| pytest | 3 files | 10 tests | 9 passed | 1 failed |" in md


def test_torn_lines_and_missing_files(tmp_path: Path) -> None:
    f = tmp_path / "tally.jsonl"
    f.write_text(json.dumps(FAKE[0]) + "\n" + '{"table": "fau' + "\n" + "[1, 2]\n")
    assert rr.read_records(f) == [FAKE[0]]
    assert rr.read_records(tmp_path / "none.jsonl") == []
    found, missing = rr.suite_files(["tests/test_reliability_report.py", "tests/no_such_*.py"])
    assert found == ["tests/test_reliability_report.py"] and missing == ["tests/no_such_*.py"]


GENERATED = """
import sys
sys.path.insert(0, {tests!r})
from tally import Tally

def test_counts():
    t = Tally("gen::counts")
    with t.fault("crash:demo"):
        pass
    with t.bad_input("path:demo"):
        pass
    t.load("coordinator-load", ranks=4, saves=2, aborted=1, rpcs=20, p99_ms=1.0, lost={lost},
           wrongly_committed=0, rss_mib_first=50.0, rss_mib_last=50.0)
"""


@pytest.mark.parametrize("lost", [0, 1])
def test_exit_status_from_a_real_run(tmp_path: Path, lost: int) -> None:
    tests = str(Path(__file__).resolve().parent)
    f = tmp_path / f"test_generated_{lost}.py"
    f.write_text(GENERATED.format(tests=tests, lost=lost))
    rc = rr.main(["--files", str(f), "--no-results", "--", "-p", "no:randomly"])
    assert rc == lost
