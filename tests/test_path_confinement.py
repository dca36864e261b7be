"""Paths from outside stay inside the root: job paths, reported shard names, and files
that pose as shards (symlinks out of the root, FIFOs), on the coordinator's side.

The reader's side (manifest and index paths, symlinked and FIFO shards at load and
verify) is in tests/test_manifest_parsing.py; tensor keys used as paths (zarr export)
are at the end here. The transport-free core, real files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_testutil import list_files
from coordinator_fixtures import TOKEN, RankSim, ServerThread, new_core, run, started

import ckpt
from ckptd.coordinator.types import SaveRef
from ckptd.errors import CkptError, InvalidRequest, UnsafePath
from ckptd.format import layout
from ckptd.server import ServerOptions

pytestmark = pytest.mark.timeout(60)

BAD_JOBS = {
    "dotdot": "../escape",
    "dotdot-inside": "team/../../escape",
    "absolute-outside": "/etc",
    "nul": "job\x00x",
    "overlong": "j" * 5000,
    "empty": "",
    "backslash": "team\\job",
    "dot-component": "team/./job",
    "dotdot-component": "team/../job",  # stays under the root once folded: still refused
    "root-itself": ".",
    "newline": "job\nx",
    "tab": "job\tx",
    "escape-sequence": "job\x1b[31m",
    "del": "job\x7f",
}
# Names users give their own jobs: accepted by every entry point alike.
GOOD_JOBS = {
    "hyperparameters": "lr=3e-4,bs=64",
    "space": "my run",
    "plus": "exp+v2",
    "cjk": "実験",
    "umlaut": "jöb",
    "nested": "team/my job (1)",
}


@pytest.mark.parametrize("bad", list(BAD_JOBS.values()), ids=list(BAD_JOBS))
def test_bad_job_paths(tmp_path: Path, tally, bad: str) -> None:
    root = tmp_path / "root"

    async def main() -> None:
        async with started(new_core(root)) as core:
            ref = SaveRef(bad, 1, 0, 0, 1)
            for call in (
                lambda: core.open_job(bad, "a"),
                lambda: core.begin_save(ref, []),
                lambda: core.keep_alive(ref),
                lambda: core.abort_save(ref, "x"),
            ):
                with pytest.raises((UnsafePath, InvalidRequest)) as ei:
                    await call()
                assert "job" in str(ei.value)
            with pytest.raises((UnsafePath, InvalidRequest)):
                core.list_checkpoints(bad)

    with tally.bad_input("path-traversal"):
        run(main())
        assert not (tmp_path / "escape").exists()
        assert not [f for f in list_files(tmp_path) if not f.startswith("root/")]


@pytest.mark.parametrize("name", list(GOOD_JOBS.values()), ids=list(GOOD_JOBS))
def test_names_users_give_jobs_save_and_load_everywhere(
    tmp_path: Path, name: str, ckptctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt.save, a Checkpointer (embedded coordinator), a client of a real gRPC server
    (what `ckptd serve` runs) and ckptctl all take the name; every step loads back."""
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
    root = tmp_path / "root"
    job = str(root / name)
    ckpt.save({"w": torch.full((3,), 1.0)}, job, step=1)
    with ckpt.Checkpointer(job) as cp:
        cp.save({"w": torch.full((3,), 2.0)}, 2, blocking=True)
    server = ServerThread(root, options=ServerOptions(token=TOKEN))
    try:
        with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a") as cp:
            assert cp.job_name == name
            cp.save({"w": torch.full((3,), 3.0)}, 3, blocking=True)
            assert [r.step for r in cp.client.list_checkpoints(job)] == [1, 2, 3]
    finally:
        server.stop()
    for step in (1, 2, 3):
        got = ckpt.load({}, job, step=step).state["w"]
        assert torch.equal(got, torch.full((3,), float(step))), (step, got)
    rc, out, err = ckptctl("verify", job)
    assert rc == 0, err
    rc, out, err = ckptctl("list", job, "--json")
    assert rc == 0 and [s["step"] for s in json.loads(out)["steps"]] == [1, 2, 3], (out, err)


def test_job_directory_symlinked_out_of_the_root(tmp_path: Path, tally) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "linked")

    async def main() -> None:
        async with started(new_core(root)) as core:
            sim = RankSim(core, str(root / "linked"), 0, 1)
            sim.prepare({"w": torch.ones(4)})
            with pytest.raises(UnsafePath, match="symlink"):
                await sim.begin(1)

    with tally.bad_input("symlink-job"):
        run(main())
        assert os.listdir(outside) == []


def _saved_up_to_report(root: Path, tamper, tally, kind: str) -> None:
    """Rank 0 of 1 begins and writes; `tamper(job)` swaps a file; the report must abort
    the save naming the file, in time, and commit nothing."""

    async def main() -> None:
        async with started(new_core(root)) as core:
            job = str(root / "job")
            sim = RankSim(core, job, 0, 1)
            sim.prepare({"w": torch.arange(1024.0)})
            await sim.begin(1)
            rep = await sim.write(1)
            tamper(job)
            st = await sim.report(1, rep)
            assert st.status == "ABORTED", st
            assert "rank-00000" in st.reason, st.reason
            assert not os.path.exists(os.path.join(job, layout.step_dir(1), layout.MANIFEST_NAME))
            # The same core then commits a clean save of the next step.
            assert (await sim.save(2, {"w": torch.ones(4)})).status == "COMMITTED"

    with tally.bad_input(kind):
        run(main(), timeout=30)


def _shard(job: str, name: str = "bin") -> str:
    return os.path.join(job, layout.step_dir(1), "shards", f"rank-00000.{name}")


def test_reported_shard_is_a_fifo(tmp_path: Path, tally) -> None:
    def fifo(job: str) -> None:
        os.unlink(_shard(job))
        os.mkfifo(_shard(job))

    _saved_up_to_report(tmp_path / "root", fifo, tally, "fifo-shard")


def test_reported_index_is_a_fifo(tmp_path: Path, tally) -> None:
    def fifo(job: str) -> None:
        os.unlink(_shard(job, "json"))
        os.mkfifo(_shard(job, "json"))

    _saved_up_to_report(tmp_path / "root", fifo, tally, "fifo-shard")


def test_reported_shard_is_a_symlink_out_of_the_root(tmp_path: Path, tally) -> None:
    secret = tmp_path / "secret.bin"

    def link(job: str) -> None:
        os.rename(_shard(job), secret)
        os.symlink(secret, _shard(job))

    _saved_up_to_report(tmp_path / "root", link, tally, "symlink-shard")


def test_reported_shards_directory_is_a_symlink(tmp_path: Path, tally) -> None:
    elsewhere = tmp_path / "elsewhere"

    def link(job: str) -> None:
        shards = os.path.dirname(_shard(job))
        os.rename(shards, elsewhere)
        os.symlink(elsewhere, shards)

    _saved_up_to_report(tmp_path / "root", link, tally, "symlink-shard")


@pytest.mark.parametrize(
    "field, bad",
    [
        ("shard_path", "../../../escape.bin"),
        ("shard_path", "/etc/passwd"),
        ("shard_path", "shards/rank-00001.bin"),  # another rank's
        ("index_path", "shards/../MANIFEST.json"),
        ("index_path", "shards/rank-00000.json\x00"),
    ],
)
def test_reported_paths_other_than_assigned(tmp_path: Path, tally, field: str, bad: str) -> None:
    root = tmp_path / "root"

    async def main() -> None:
        async with started(new_core(root)) as core:
            sim = RankSim(core, str(root / "job"), 0, 1)
            sim.prepare({"w": torch.ones(4)})
            await sim.begin(1)
            rep = await sim.write(1)
            with pytest.raises(InvalidRequest, match="assigned"):
                await sim.report(1, dataclasses.replace(rep, **{field: bad}))
            # The real report still commits: a refused report does not spoil the save.
            assert (await sim.report(1, rep)).status in ("COMMITTING", "COMMITTED")
            assert (await core.await_commit(sim.ref(1), 10)).status == "COMMITTED"

    with tally.bad_input("path-traversal"):
        run(main())


def test_hostile_keys_stay_inside_a_zarr_export(tmp_path: Path, tally, ckptctl) -> None:
    """Tensor keys become zarr node paths: `..`, absolute and empty components are escaped."""
    pytest.importorskip("tensorstore")
    job, out = str(tmp_path / "job"), tmp_path / "out" / "x.zarr"
    keys = ["../../escape", "/abs", "a//b", "./dot", "__private"]
    ckpt.save({k: torch.full((3,), float(i)) for i, k in enumerate(keys)}, job, step=1)
    with tally.bad_input("path-traversal:key"):
        rc, _, err = ckptctl("restore", job, "--to", out, "--format", "zarr")
        assert rc == 0, err
        for f in list_files(tmp_path):
            assert f.startswith(("job/", "out/x.zarr/")), f
        assert not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()


def test_error_names_the_file(tmp_path: Path) -> None:
    """A sanity check that the FIFO refusal is about the file, not a generic failure."""
    root = tmp_path / "root"

    async def main() -> str:
        async with started(new_core(root)) as core:
            sim = RankSim(core, str(root / "job"), 0, 1)
            sim.prepare({"w": torch.ones(4)})
            await sim.begin(1)
            rep = await sim.write(1)
            os.unlink(_shard(sim.job))
            os.mkfifo(_shard(sim.job))
            return (await sim.report(1, rep)).reason

    reason = run(main(), timeout=30)
    assert "not a regular file" in reason, reason
    assert isinstance(reason, str) and not isinstance(reason, CkptError)
