"""ckptctl: the --json schemas, exit codes, progress only on a terminal, and `diff`.

Checkpoints are real: single-process saves through ckpt.save, and a two-rank save through
the real coordinator core (two RankSims, each writing its half of a tensor) for a step whose
chunk layout differs. ckptctl runs in-process (fast) and as a real subprocess, once with its
stderr on a pseudo-terminal.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from coordinator_fixtures import REPO, RankSim, child_env, new_core, run, started

import ckpt

# The keys docs/cli.md promises for each command's --json document (beyond command/path/ok).
SCHEMA = {
    "list": {"steps"},
    "inspect": {"step", "generation", "world_size", "bytes", "shards", "tensors", "metadata"},
    "verify": {"steps"},
    "gc": {"dry_run", "removed", "steps", "stray_files", "recycled_files"},
    "restore": {"step", "format", "to", "tensors", "bytes", "bytes_verified", "seconds"},
    "diff": {"step_a", "step_b", "identical", "changed", "added", "removed", "unchanged", "keys"},
}


@pytest.fixture(autouse=True)
def _one_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_PATH"):
        monkeypatch.delenv(k, raising=False)


def gen(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def two_steps(tmp_path: Path) -> str:
    """Step 1 and step 2 of one job: b changed in one element, c removed, d added, lr changed."""
    job = str(tmp_path / "job")
    a, b, c = gen(1, 64, 32), gen(2, 128), gen(3, 8, 8)
    ckpt.save({"model": {"a": a, "b": b, "c": c}, "lr": 0.1, "name": "x"}, job, step=1)
    b2 = b.clone()
    b2[17] += 1
    ckpt.save({"model": {"a": a, "b": b2, "d": gen(4, 4)}, "lr": 0.05, "name": "x"}, job, step=2)
    return job


def test_json_on_every_command_has_the_documented_keys(
    ckptctl, two_steps: str, tmp_path: Path
) -> None:
    runs = {
        "list": ("list", two_steps),
        "inspect": ("inspect", two_steps),
        "verify": ("verify", two_steps, "--all"),
        "gc": ("gc", two_steps, "--dry-run", "--keep-last", "1"),
        "restore": ("restore", two_steps, "--to", tmp_path / "out.pt", "--format", "torch"),
        "diff": ("diff", two_steps, "1", "2"),
    }
    for command, argv in runs.items():
        rc, out, err = ckptctl(*argv, "--json")
        assert rc == 0, (command, err)
        doc = json.loads(out)  # exactly one document, nothing else on stdout
        assert doc["command"] == command and doc["ok"] is True and doc["path"], doc
        assert SCHEMA[command] <= doc.keys(), (command, SCHEMA[command] - doc.keys())
        assert "\x1b" not in err, (command, err)  # no progress bar, no colour with --json
    assert json.loads(ckptctl("gc", two_steps, "--dry-run", "--keep-last", "1", "--json")[1])[
        "steps"
    ] == [{"step": 1, "reason": "retired by --keep-last"}]


def test_exit_codes(ckptctl, two_steps: str, tmp_path: Path) -> None:
    assert ckptctl("verify", two_steps)[0] == 0
    # 2: usage (argparse, and arguments that parse but make no sense)
    for argv in (
        ("frobnicate", two_steps),
        ("diff", two_steps, "1"),
        ("diff", two_steps, "one", "2"),
        ("verify", two_steps, "--level", "paranoid"),
        ("restore", two_steps, "--format", "torch"),
    ):
        assert ckptctl(*argv)[0] == 2, argv
    rc, out, err = ckptctl("gc", two_steps, "--keep-last", "0", "--json")
    assert rc == 2 and "--keep-last" in err
    assert json.loads(out) == {
        "command": "gc",
        "path": two_steps,
        "ok": False,
        "error": "--keep-last must be at least 1 (the newest checkpoint is always kept)",
        "exit_code": 2,
    }
    steps = sorted(n for n in os.listdir(two_steps) if n != ".ckptd")  # the catalog aside
    assert steps == ["step-000000000001", "step-000000000002"]
    # 1: a problem found; the message names what and where, and the JSON says so too
    rc, out, err = ckptctl("inspect", two_steps, "--step", "9", "--json")
    assert rc == 1 and "9" in err
    assert json.loads(out)["ok"] is False and json.loads(out)["exit_code"] == 1
    rc, _, err = ckptctl("diff", two_steps, "1", "9")
    assert rc == 1 and "9" in err
    missing = str(tmp_path / "nope")
    for cmd in ("list", "inspect", "verify", "diff"):
        argv = (cmd, missing, "1", "2") if cmd == "diff" else (cmd, missing)
        rc, out, err = ckptctl(*argv, "--json")
        assert rc == 1 and missing in err, (cmd, err)
        assert json.loads(out)["error"].startswith(missing)


def test_diff_from_the_index_without_reading_data(ckptctl, two_steps: str) -> None:
    rc, out, err = ckptctl("diff", two_steps, "1", "2", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["changed"] == ["model/b", "lr"]
    assert doc["added"] == ["model/d"] and doc["removed"] == ["model/c"]
    assert doc["identical"] is False and doc["unchanged"] == 2  # model/a and name
    assert doc["bytes_read"] == 0  # equal layouts: block hashes from the indexes suffice
    by = {k["key"]: k for k in doc["keys"]}
    assert by["model/b"]["by"] == "index" and by["model/b"]["kind"] == "tensor"
    assert by["lr"]["kind"] == "value" and "model/a" not in by  # unchanged only with --all
    assert ckptctl("diff", two_steps, "1", "2", "--exit-code")[0] == 1
    assert ckptctl("diff", two_steps, "2", "2", "--exit-code")[0] == 0
    rc, out, _ = ckptctl("diff", two_steps, "1", "2", "--all")
    lines = out.splitlines()
    assert "M model/b (index: 1 of 1 chunk(s) differ)" in lines
    assert "A model/d" in lines and "D model/c" in lines and "M lr [value]" in lines
    assert "= model/a" in lines
    assert lines[-1] == "step 1 -> 2: 2 changed, 1 added, 1 removed, 2 unchanged"


async def _two_rank_save(root: Path, step: int, w: torch.Tensor, v: torch.Tensor) -> None:
    """Rows [0, 2) on rank 0 and [2, 4) on rank 1: another chunk layout than one rank's."""
    core = new_core(root)
    async with started(core):
        ranks = [RankSim(core, str(root / "job"), r, 2) for r in range(2)]
        for r, sim in enumerate(ranks):
            rows = slice(2 * r, 2 * r + 2)
            sim.prepare(
                {"w": w[rows].clone(), "v": v[rows].clone()},
                boxes={
                    "w": ([4, w.shape[1]], [2 * r, 0], [2, w.shape[1]]),
                    "v": ([4, v.shape[1]], [2 * r, 0], [2, v.shape[1]]),
                },
            )
        results = await asyncio.gather(*(sim.save(step) for sim in ranks))
        assert all(r.status == "COMMITTED" for r in results), results


def test_diff_across_a_resharding_reads_and_hashes_the_logical_tensor(
    ckptctl, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    job = str(root / "job")
    w, v = gen(5, 4, 300), gen(6, 4, 50)
    ckpt.save({"w": w, "v": v}, job, step=1)
    v2 = v.clone()
    v2[3, 49] = 7.0  # the last element: in rank 1's chunk of step 2
    run(_two_rank_save(root, 2, w, v2))
    rc, out, err = ckptctl("diff", job, "1", "2", "--json", "--all")
    assert rc == 0, err
    doc = json.loads(out)
    by = {k["key"]: k for k in doc["keys"]}
    assert by["w"]["status"] == "same" and by["w"]["by"] == "read"
    assert by["v"]["status"] == "changed" and by["v"]["by"] == "read"
    assert doc["bytes_read"] == 2 * (w.numel() + v.numel()) * 4
    # The fallback reads verified blocks: a corrupt shard is a problem, named, not a diff.
    shard = next((Path(job) / "step-000000000002" / "shards").glob("rank-00001*.bin"))
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out, err = ckptctl("diff", job, "1", "2", "--json")
    assert rc == 1 and "rank-00001" in err and "'w'" in err, err
    assert json.loads(out)["ok"] is False


def test_human_readable_text(ckptctl, two_steps: str, tmp_path: Path) -> None:
    rc, out, _ = ckptctl("list", two_steps)
    assert rc == 0 and "KiB" in out and " ago)" in out
    rc, out, _ = ckptctl("verify", two_steps, "--all")
    assert rc == 0 and "checked in" in out and ("ms" in out or " s)" in out)
    rc, out, _ = ckptctl("restore", two_steps, "--to", tmp_path / "o.pt", "--format", "torch")
    assert rc == 0 and "KiB" in out


def _subprocess(*args: str, stderr_tty: bool) -> tuple[int, str, str]:
    """Run the real `python -m ckptd.cli.ckptctl` with stderr a pipe or a pseudo-terminal."""
    cmd = [sys.executable, "-m", "ckptd.cli.ckptctl", *args]
    if not stderr_tty:
        p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # read the terminal while the child runs: its buffer is small
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not b:
                return
            chunks.append(b)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=slave, env=child_env(), cwd=REPO
        ) as proc:
            os.close(slave)
            out, _ = proc.communicate(timeout=60)
        reader.join(10)
        return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


def test_progress_on_a_terminal_only(two_steps: str) -> None:
    rc, out, err = _subprocess("verify", two_steps, "--all", stderr_tty=True)
    assert rc == 0 and "step 2: OK" in out
    assert "verify step" in err, err  # the rich bar, drawn on the terminal
    rc, out, err = _subprocess("verify", two_steps, "--all", "--json", stderr_tty=True)
    assert rc == 0 and json.loads(out)["ok"] and err == "", err  # never with --json
    rc, out, err = _subprocess("verify", two_steps, "--all", stderr_tty=False)
    assert rc == 0 and err == ""  # quiet in pipes
    rc, out, err = _subprocess("verify", two_steps, "--all", "--no-progress", stderr_tty=True)
    assert rc == 0 and err == ""


def test_diff_as_a_real_subprocess(two_steps: str) -> None:
    rc, out, err = _subprocess(
        "diff", two_steps, "1", "2", "--json", "--exit-code", stderr_tty=False
    )
    assert rc == 1 and err == ""  # they differ: --exit-code says so, and it is not an error
    doc = json.loads(out)
    assert doc["ok"] is True and doc["changed"] == ["model/b", "lr"]
