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


def test_a_missing_path_or_a_file_is_a_problem_for_every_command(
    ckptctl, tmp_path: Path, tally
) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("not a job")
    for bad, what in ((tmp_path / "nope", "does not exist"), (afile, "is a file")):
        for cmd in ("list", "inspect", "verify", "gc", "restore", "diff"):
            extra = {
                "diff": ("1", "2"),
                "restore": ("--to", tmp_path / "o.pt", "--format", "torch"),
            }
            with tally.bad_input(f"ckptctl {cmd}: path that {what}"):
                rc, out, err = ckptctl(cmd, bad, *extra.get(cmd, ()), "--json")
                assert rc == 1 and err.startswith("error: ") and what in err, (cmd, err)
                doc = json.loads(out)
                assert doc["ok"] is False and doc["exit_code"] == 1 and what in doc["error"]
                assert doc["path"] == str(bad)
    assert not (tmp_path / "nope").exists()  # gc did not create it


def test_verify_of_an_absent_step_is_not_corrupt(ckptctl, two_steps: str) -> None:
    rc, out, err = ckptctl("verify", two_steps, "--step", "999", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["steps"] == [] and doc["exit_code"] == 1
    assert "no step 999" in doc["error"] and "1, 2" in doc["error"], doc
    rc, out, err = ckptctl("verify", two_steps, "--step", "999")
    assert rc == 1 and "CORRUPT" not in out + err and "no step 999" in err
    os.makedirs(os.path.join(two_steps, "step-000000000005"))  # a save that never committed
    rc, out, err = ckptctl("verify", two_steps, "--step", "5", "--json")
    assert rc == 1 and "never committed" in json.loads(out)["error"]
    assert "CORRUPT" not in out + err


def test_a_failed_verify_document_has_error_and_exit_code(ckptctl, two_steps: str) -> None:
    shard = next((Path(two_steps) / "step-000000000002" / "shards").glob("rank-*.bin"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    rc, out, err = ckptctl("verify", two_steps, "--all", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert "step(s) 2 failed verification" in doc["error"] and shard.name in doc["error"]
    assert err.strip() == f"error: {doc['error']}"
    rc, out, err = ckptctl("verify", two_steps, "--all")
    assert rc == 1 and "step 2: CORRUPT" in out and "step 1: OK" in out
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_list_coordinator_names_the_job_absolutely(
    ckptctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator_fixtures import TOKEN, ServerThread, finished

    from ckptd.server import ServerOptions

    root = tmp_path / "root"
    server = ServerThread(root, options=ServerOptions(token=TOKEN))
    try:
        job = root / "job"
        with ckpt.Checkpointer(str(job), coordinator=server.address, token=TOKEN) as cp:
            finished(cp.save({"w": gen(1, 4)}, 3))
        monkeypatch.chdir(tmp_path)
        argv = ("list", "root/job", "--coordinator", server.address, "--token", TOKEN, "--json")
        rc, out, err = ckptctl(*argv)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["path"] == str(job) and [s["step"] for s in doc["steps"]] == [3], doc
        rc, out, err = ckptctl("verify", "root/job", "--coordinator", server.address,
                               "--token", TOKEN, "--json")  # fmt: skip
        assert rc == 0 and json.loads(out)["path"] == str(job), err
    finally:
        server.stop(0.2)


@pytest.fixture
def read_only_job(two_steps: str, tmp_path: Path):  # noqa: ANN201 - yields the mount's path
    """The job, seen through a read-only bind mount (root), or read-only modes (others)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        for d, _, _ in os.walk(two_steps):
            os.chmod(d, 0o555)
        try:
            yield two_steps
        finally:
            for d, _, _ in os.walk(two_steps):
                os.chmod(d, 0o755)
        return
    mount = ["mount", "--bind", two_steps, str(ro)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True
        ).returncode:
            pytest.skip("cannot remount read-only here")
        yield str(ro)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_gc_on_read_only_storage_is_one_error_line_and_a_json_document(
    ckptctl, read_only_job: str, tally
) -> None:
    with tally.bad_input("ckptctl gc: read-only storage"):
        rc, out, err = ckptctl("gc", read_only_job, "--keep-last", "1", "--json")
        assert rc == 1, err
        doc = json.loads(out)
        assert doc["ok"] is False and doc["exit_code"] == 1 and doc["command"] == "gc"
        assert "step-000000000001" in doc["error"], doc
        assert "Read-only" in doc["error"] or "Permission" in doc["error"], doc
        assert "Traceback" not in err and err.strip() == f"error: {doc['error']}"
    rc, out, err = ckptctl("gc", read_only_job, "--keep-last", "1")
    assert rc == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    # Reading still works there.
    assert ckptctl("verify", read_only_job, "--all")[0] == 0
    assert ckptctl("list", read_only_job)[0] == 0


def test_gc_tolerates_what_vanishes_under_it(
    ckptctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally
) -> None:
    """Another process removes each thing gc removes, first (the whole of it, or a part):
    gc's unlink then meets FileNotFoundError, as when a save's retention retires the same
    step or a save takes a recycled file while gc runs."""
    import shutil

    from ckptd.cli import ckptctl as cli
    from ckptd.storage import LocalStorage

    job = str(tmp_path / "job")
    for step in (1, 2, 3, 4):
        ckpt.save({"w": gen(step, 256)}, job, step=step, keep_last=3)  # 1 -> the pool
    os.makedirs(os.path.join(job, "step-000000000000"))  # debris of an unfinished save
    raced: list[str] = []

    class Racing(LocalStorage):
        def remove_tree(self, path: str) -> None:
            full = os.path.join(self.root, path)
            if path in raced or not os.path.lexists(full):
                return super().remove_tree(path)
            raced.append(path)
            if os.path.isdir(full) and os.listdir(full) and len(raced) % 2:
                victim = os.path.join(full, sorted(os.listdir(full))[0])  # part of it
            else:
                victim = full  # all of it
            shutil.rmtree(victim) if os.path.isdir(victim) else os.unlink(victim)
            raise FileNotFoundError(2, "No such file or directory", victim)

    monkeypatch.setattr(cli, "open_storage", lambda p, **kw: Racing(str(p)))
    with tally.fault("ckptctl gc: files vanish under it (a racing save)"):
        rc, out, err = ckptctl("gc", job, "--keep-last", "1", "--json")
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["ok"] and doc["removed"] == [0, 2, 3] and doc["recycled_files"] >= 1
    assert raced  # the race was run
    assert sorted(n for n in os.listdir(job) if n.startswith("step-")) == ["step-000000000004"]
    assert not os.listdir(os.path.join(job, ".ckptd", "recycle"))
    assert ckpt.load({}, job).step == 4


def test_gc_beside_a_saving_process(ckptctl, tmp_path: Path) -> None:
    """The real race: a process saves with keep_last (retiring steps, reusing recycled
    files) while gc runs again and again: every gc run ends in a JSON document."""
    job = str(tmp_path / "job")
    ckpt.save({"w": gen(0, 1 << 14)}, job, step=0)
    code = (
        "import ckpt, torch, sys\n"
        "for s in range(1, 41):\n"
        "    ckpt.save({'w': torch.full((1 << 14,), float(s))}, sys.argv[1], step=s, keep_last=2)\n"
    )
    saver = subprocess.Popen([sys.executable, "-c", code, job], env=child_env(), cwd=REPO)
    try:
        runs = 0
        while saver.poll() is None or runs < 3:
            rc, out, err = ckptctl("gc", job, "--keep-last", "1", "--json")
            assert rc == 0 and "Traceback" not in err, err
            assert json.loads(out)["ok"] is True
            runs += 1
        assert saver.wait(120) == 0
    finally:
        saver.kill()
        saver.wait()
    assert ckpt.load({}, job).step == 40
