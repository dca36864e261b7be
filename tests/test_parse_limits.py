"""Parsing storage's JSON under a hard memory limit, and coverage-guided fuzzing.

tests/fuzz/parse_bounded.py runs in a subprocess whose address space is capped
(RLIMIT_AS): byte mutations of a real manifest and index, then bombs (millions of entries,
million-shard manifests, deep nesting, huge numbers and strings, a million-node state).
Each must parse or be refused with a CkptError, never a MemoryError, and the peak RSS must
stay within a fixed multiple of the input size: nothing ckptd reads is larger than
CKPT_MAX_MANIFEST_BYTES / CKPT_MAX_INDEX_BYTES (refused before reading, see
test_manifest_parsing.test_oversized_json), and parsing costs at most AMPLIFICATION times
the bytes (Python's JSON objects; docs/security.md). tests/fuzz/atheris_parsers.py is the
libFuzzer harness; it runs briefly here when atheris is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator_fixtures import child_env

import ckpt

FUZZ = Path(__file__).resolve().parent / "fuzz"
# Peak RSS growth per byte of a hostile JSON input (measured ~35x for `[{},{},...]`).
AMPLIFICATION = 40


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    job = str(tmp_path_factory.mktemp("seed") / "job")
    ckpt.save(
        {
            "w": torch.arange(12.0).reshape(3, 4),
            "b": torch.arange(5),
            "plain": {"lr": 0.5, "name": "x", "rng": [1, 2, 3]},
        },
        job,
        step=1,
    )
    return os.path.join(job, "step-000000000001")


def run_bounded(step_dir: str, *, iterations: int, bomb_mib: int, seed: int) -> dict[str, Any]:
    # What the process needs before parsing (~150 MiB of mappings) plus the bound.
    limit_mib = 256 + AMPLIFICATION * bomb_mib
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ / "parse_bounded.py"),
            step_dir,
            "--iterations",
            str(iterations),
            "--bomb-mib",
            str(bomb_mib),
            "--as-limit-mib",
            str(limit_mib),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert proc.stdout, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert proc.returncode == 0, out["failures"][:10]
    return out


def check_bounded(out: dict[str, Any], bomb_mib: int, iterations: int, tally: Any) -> None:
    for i in range(iterations):
        with tally.bad_input("manifest-fuzz" if i % 2 == 0 else "index-fuzz"):
            assert not any(f.startswith(f"mutation {i}:") for f in out["failures"])
    for name, size in out["bomb_bytes"].items():
        with tally.bad_input("manifest-bomb" if name.startswith("manifest") else "index-bomb"):
            assert size >= bomb_mib << 20
            if name == "state-million-nodes":
                continue  # valid, only large: it must parse within the limit, and did
            assert name in out["refused"], name
            assert out["refused"][name].startswith("InvalidManifest"), out["refused"][name]
    growth = out["peak_rss_mib"] - out["base_rss_mib"]
    assert growth <= AMPLIFICATION * bomb_mib + 32, out


def test_parsers_under_a_memory_limit(step_dir, tally):
    iterations, bomb_mib = 300, 4
    out = run_bounded(step_dir, iterations=iterations, bomb_mib=bomb_mib, seed=1)
    check_bounded(out, bomb_mib, iterations, tally)
    refused = out["refused"]
    assert "over the limit of 1000000" in refused["index-million-entries"]
    assert "nested too deeply" in refused["manifest-deep-nesting"]
    assert "job is over" in refused["manifest-huge-key"]


@pytest.mark.slow
def test_parsers_under_a_memory_limit_long(step_dir, tally):
    iterations, bomb_mib = 20_000, 48
    out = run_bounded(step_dir, iterations=iterations, bomb_mib=bomb_mib, seed=2)
    check_bounded(out, bomb_mib, iterations, tally)


def test_atheris_parsers(step_dir, tmp_path, tally):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copyfile(os.path.join(step_dir, "MANIFEST.json"), corpus / "manifest.json")
    shutil.copyfile(os.path.join(step_dir, "shards", "rank-00000.json"), corpus / "index.json")
    runs = int(os.environ.get("CKPT_ATHERIS_RUNS", "3000"))
    with tally.bad_input("manifest-fuzz:atheris"):
        proc = subprocess.run(
            [
                sys.executable,
                str(FUZZ / "atheris_parsers.py"),
                str(corpus),
                f"-runs={runs}",
                "-rss_limit_mb=1024",
                "-timeout=10",
                "-max_len=8192",
                f"-artifact_prefix={tmp_path}/",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=child_env(),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"Done {runs} runs" in proc.stderr
