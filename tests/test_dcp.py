"""torch.distributed.checkpoint through ckptd (ckpt.integrations.dcp), with real ranks.

One torchrun job of 2 gloo ranks on CPU (tests/ranks/dcp_worker.py) saves FSDP2 model and
optimizer state, a row-sharded DTensor and plain values with dcp.save and dcp.async_save,
loads them back with dcp.load (same world, another placement) and ckpt.load, and sees a
non-plain value refused. This file then checks, from storage alone: the steps are ordinary
ckptd checkpoints (ckptctl verify, ckptctl restore, ckpt.load into an empty dict), nothing
pickled was written, dcp.load reshards 2 -> 1 in this process, and a flipped byte in a
shard makes dcp.load fail naming the file and key.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from coordinator_fixtures import TESTS, TOKEN, ServerThread, child_env, ckptctl, shard_index_keys

import ckpt
from ckptd.errors import UnsupportedValue

dcp = pytest.importorskip("torch.distributed.checkpoint")
from ckpt.integrations import _plain  # noqa: E402
from ckpt.integrations.dcp import StorageReader, StorageWriter  # noqa: E402

# dcp.save/load in one process (no process group) warns that it assumes one process.
NO_DIST = "ignore:torch.distributed is disabled:UserWarning"


@pytest.fixture(autouse=True)
def _close_coordinators():  # noqa: ANN202
    """Stop the embedded coordinators this test's saves started (they live per process)."""
    yield
    from ckpt.integrations import _coordinator

    _coordinator.close_all()


def step_dir(job: Path, step: int) -> Path:
    return job / f"step-{step:012d}"


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("dcp")
    job, out = base / "ckpts" / "run", base / "out"
    out.mkdir()
    log = base / "torchrun.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(TESTS / "ranks" / "dcp_worker.py"),
        str(job),
        str(out),
    ]
    with open(log, "wb") as f:
        p = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=150, cwd=base
        )
    assert p.returncode == 0, log.read_text(errors="replace")[-6000:]
    return job, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_two_ranks_save_load_async_through_dcp(torchrun_job) -> None:
    job, results = torchrun_job
    for res in results:
        assert not res.get("error"), res.get("error")
        assert res["checks"] and all(res["checks"].values()), (res["rank"], res["checks"])
        # Refused on every rank (DCP gathers the failing rank's error), naming the key.
        assert "UnsupportedValue" in res["refused"] and "'bad'" in res["refused"], res["refused"]
        assert "without pickle" in res["refused"]
    m = json.loads((step_dir(job, 1) / "MANIFEST.json").read_text())
    assert m["world_size"] == 2 and [s["rank"] for s in m["shards"]] == [0, 1]
    assert m["metadata"]["world"] == 2 and m["metadata"]["dcp"]["version"] == 1
    # DCP deduplicated the replicated tensor: written once; the DTensor rows in 2 chunks.
    keys = [k for ks in shard_index_keys(job, 1).values() for k in ks]
    assert [k for k in keys if k[0] == "rep"] == [("rep", (0,), (5,))]
    assert sorted(k[1:] for k in keys if k[0] == "rows") == [((0, 0), (6, 6)), ((6, 0), (6, 6))]
    assert (step_dir(job, 2) / "MANIFEST.json").exists()  # async_save committed
    assert not (step_dir(job, 3) / "MANIFEST.json").exists()  # refused: nothing committed


@pytest.mark.multiprocess
def test_dcp_shards_are_packed_and_hold_each_chunk_once(torchrun_job) -> None:
    # DCP's planner assigns each replica to one rank and the shards are written packed
    # (format v2): the files' sizes add up to the distinct chunks' bytes (plus alignment).
    job, _ = torchrun_job
    for step in (1, 2):
        m = json.loads((step_dir(job, step) / "MANIFEST.json").read_text())
        assert m["version"] == 2
        chunks: list[tuple] = []
        for sh in m["shards"]:
            idx = json.loads((step_dir(job, step) / sh["index"]).read_text())
            assert idx["version"] == 2
            size = (step_dir(job, step) / sh["path"]).stat().st_size
            ends, pos = sorted((e["offset"], e["length"]) for e in idx["entries"]), 0
            for off, n in ends:
                assert off == pos, (step, sh["path"], off, pos)  # no hole before it
                pos = -(-(off + n) // m["alignment"]) * m["alignment"]
            assert size == sh["size"] == pos, (step, sh["path"], size, pos)
            chunks += [(e["key"], tuple(e["chunk_offsets"])) for e in idx["entries"]]
        assert len(chunks) == len(set(chunks)), f"step {step}: a chunk is stored twice"


@pytest.mark.multiprocess
def test_dcp_steps_are_ordinary_ckptd_checkpoints(torchrun_job, tmp_path: Path) -> None:
    job, results = torchrun_job
    rc, out, err = ckptctl("verify", str(job), "--all")
    assert rc == 0 and "step 1: OK" in out and "step 2: OK" in out, out + err
    # ckpt.load into an empty dict: the nested structure of the DCP state dict.
    loaded = ckpt.load({}, job, step=1).state
    expected = results[0]["expected"]
    for key, value in expected.items():
        group, rest = key.split("/", 1)
        t = loaded[group]
        for part in rest.split("/"):
            t = t[part]
        assert torch.equal(t, torch.tensor(value, dtype=t.dtype)), key
    assert loaded["step"] == 7
    assert loaded["cfg"] == {"name": "run", "betas": (0.9, 0.99), "none": None}
    assert torch.equal(loaded["rows"], torch.arange(72, dtype=torch.float32).reshape(12, 6))
    out_file = tmp_path / "restored.safetensors"
    rc, out, err = ckptctl(
        "restore", str(job), "--step", "1", "--to", str(out_file), "--format", "safetensors"
    )
    assert rc == 0 and out_file.stat().st_size > 0, out + err


@pytest.mark.multiprocess
def test_nothing_pickled_is_written(torchrun_job) -> None:
    job, _ = torchrun_job
    for step in (1, 2):
        files = sorted(p for p in step_dir(job, step).rglob("*") if p.is_file())
        assert {p.suffix for p in files} == {".json", ".bin"}, files  # no DCP .metadata
        for p in files:
            if p.suffix == ".json":
                json.loads(p.read_text())  # every description is JSON
    m = json.loads((step_dir(job, 1) / "MANIFEST.json").read_text())
    fqns = m["metadata"]["dcp"]["fqns"]
    assert fqns["step"] == {"path": ["step"], "value": "plain"}
    assert fqns["model.0.weight"] == {"path": ["model", "0.weight"], "key": "model/0.weight"}


@pytest.mark.multiprocess
@pytest.mark.filterwarnings(NO_DIST)
def test_dcp_load_reshards_two_ranks_to_one(torchrun_job) -> None:
    job, results = torchrun_job
    expected = results[0]["expected"]
    sd = {
        "model": {
            k.split("/", 1)[1]: torch.zeros(torch.tensor(v).shape)
            for k, v in expected.items()
            if k.startswith("model/")
        },
        "rows": torch.zeros(12, 6),
        "rep": torch.zeros(5, dtype=torch.bfloat16),
        "step": 0,
    }
    dcp.load(sd, storage_reader=StorageReader(job, step=1))
    for name, t in sd["model"].items():
        assert torch.equal(t, torch.tensor(expected[f"model/{name}"])), name
    assert torch.equal(sd["rows"], torch.arange(72, dtype=torch.float32).reshape(12, 6))
    assert torch.equal(sd["rep"], torch.full((5,), 2.5, dtype=torch.bfloat16))
    assert sd["step"] == 7


@pytest.mark.multiprocess
@pytest.mark.filterwarnings(NO_DIST)
def test_corrupt_shard_fails_dcp_load_naming_file_and_key(torchrun_job, tmp_path: Path) -> None:
    src, _ = torchrun_job
    job = tmp_path / "run"
    shutil.copytree(step_dir(src, 1), step_dir(job, 1))
    index = json.loads((step_dir(job, 1) / "shards" / "rank-00001.json").read_text())
    entry = next(e for e in index["entries"] if e["key"] == "rows")
    shard = step_dir(job, 1) / "shards" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    sd = {"rows": torch.zeros(12, 6)}
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException is a BaseException
        dcp.load(sd, storage_reader=StorageReader(job, step=1))
    msg = str(ei.value)
    assert "HashMismatch" in msg and "rank-00001.bin" in msg and "'rows'" in msg, msg
    assert "failed verification" in msg and "ckptctl verify" in msg, msg
    assert not sd["rows"][6:].any()  # nothing from the corrupt block reached the state
    rc, out, _ = ckptctl("verify", str(job), "--step", "1")
    assert rc == 1 and "rows" in out


@pytest.mark.filterwarnings(NO_DIST)
def test_one_process_save_load_plain_values_and_bytesio(tmp_path: Path) -> None:
    job = tmp_path / "job"
    sd = {
        "w": torch.arange(6.0).reshape(2, 3),
        "blob": io.BytesIO(b"\x00raw"),
        "nums": [1, 2.5, float("inf")],
        "meta": {"k": (1, "x"), "b": b"\xff"},
    }
    dcp.save(sd, storage_writer=StorageWriter(job, step=5, metadata={"run": "a"}))
    got = {"w": torch.zeros(2, 3), "blob": io.BytesIO(), "nums": [], "meta": {"k": None, "b": None}}
    dcp.load(got, storage_reader=StorageReader(job))
    assert torch.equal(got["w"], sd["w"]) and got["blob"].getvalue() == b"\x00raw"
    assert got["nums"] == [1, 2.5, float("inf")] and got["meta"] == sd["meta"]
    loaded = ckpt.load({}, job)
    assert loaded.step == 5 and loaded.metadata["run"] == "a"
    assert loaded.state["blob"] == b"\x00raw"  # ckpt.load gives the bytes


@pytest.mark.filterwarnings(NO_DIST)
def test_committed_step_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    job = tmp_path / "job"
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(job, step=1))
    before = (step_dir(job, 1) / "MANIFEST.json").read_bytes()
    with pytest.raises(BaseException, match="already committed"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(job, step=1))
    assert (step_dir(job, 1) / "MANIFEST.json").read_bytes() == before


@pytest.mark.filterwarnings(NO_DIST)
def test_ckpt_save_checkpoint_is_refused_by_dcp_reader_with_advice(tmp_path: Path) -> None:
    job = tmp_path / "job"
    ckpt.save({"w": torch.ones(3)}, job, step=1)
    with pytest.raises(BaseException, match="not written through ckpt.integrations.dcp"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=StorageReader(job))


def test_plain_values_round_trip_and_others_are_refused_by_key() -> None:
    value = {"a": [1, None, True], "t": (1.5, float("nan")), 3: {"b": b"\x01"}}
    back = _plain.from_node(_plain.to_node(value, "v"))
    assert back["a"] == [1, None, True] and back[3] == {"b": b"\x01"}
    assert back["t"][0] == 1.5 and back["t"][1] != back["t"][1]
    with pytest.raises(UnsupportedValue, match=r"hparams/fn: a value of type builtins.function"):
        _plain.to_node({"fn": lambda: 0}, "hparams")
    with pytest.raises(UnsupportedValue, match="dict key"):
        _plain.to_node({(1, 2): 0}, "hparams")


def test_writer_options_are_checked() -> None:
    with pytest.raises(ValueError, match="verify"):
        StorageWriter("/tmp/x", step=1, verify="none")
    with pytest.raises(ValueError, match="reserved"):
        StorageWriter("/tmp/x", step=1, metadata={"dcp": 1})
    with pytest.raises(ValueError, match="step"):
        StorageWriter("/tmp/x", step=-1)


class TruncatingWriter(StorageWriter):
    """Damages rank 0's shard between the write and the commit (a disk that lost a tail)."""

    def finish(self, metadata, results) -> None:  # noqa: ANN001
        shard = Path(self.path) / "step-000000000002" / "shards" / "rank-00000.bin"
        with open(shard, "r+b") as f:
            f.truncate(4096)
        super().finish(metadata, results)


@pytest.mark.filterwarnings(NO_DIST)
def test_the_coordinator_refuses_a_shard_damaged_before_the_commit(tmp_path: Path) -> None:
    job = tmp_path / "job"
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(job, step=1))
    with pytest.raises(BaseException, match=r"step 2.*not committed.*rank 0"):
        dcp.save({"w": torch.zeros(8192)}, storage_writer=TruncatingWriter(job, step=2))
    assert not (step_dir(job, 2) / "MANIFEST.json").exists()
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=StorageReader(job))  # the previous step is untouched
    assert torch.equal(got["w"], torch.ones(3))


@pytest.mark.filterwarnings(NO_DIST)
def test_an_older_attempt_is_fenced_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    job, other = tmp_path / "job", tmp_path / "other"
    sd = {"w": torch.ones(4)}
    dcp.save(sd, storage_writer=StorageWriter(job, step=1, attempt="launch-1"))
    # A checkpoint_id given to dcp.save names the job directory (the writer keeps its step).
    dcp.save(sd, checkpoint_id=other, storage_writer=StorageWriter(job, step=7))
    assert (step_dir(other, 7) / "MANIFEST.json").exists()
    dcp.save(sd, storage_writer=StorageWriter(job, step=2, attempt="launch-2", keep_last=1))
    with pytest.raises(BaseException, match="fenced"):
        dcp.save(sd, storage_writer=StorageWriter(job, step=3, attempt="launch-1"))
    assert not (step_dir(job, 3) / "MANIFEST.json").exists()
    assert ckpt.load({}, job).step == 2
    assert not (step_dir(job, 1) / "MANIFEST.json").exists()  # keep_last=1 retired step 1


@pytest.mark.filterwarnings(NO_DIST)
def test_save_through_a_ckptd_service_with_its_token(tmp_path: Path) -> None:
    from ckptd.errors import Unauthenticated
    from ckptd.server import ServerOptions

    root = tmp_path / "root"
    server = ServerThread(root, options=ServerOptions(token=TOKEN))
    try:
        job = root / "team" / "run"
        w = StorageWriter(job, step=4, coordinator=server.address, token=TOKEN)
        dcp.save({"w": torch.arange(5.0)}, storage_writer=w)
        assert server.core.catalog.save("team/run", 4).status == "COMMITTED"
        assert not (job / ".ckptd").exists()  # the service's catalog, no embedded one
        bad = StorageWriter(job, step=5, coordinator=server.address, token="wrong")
        # DCP wraps the coordinator rank's error in its CheckpointException.
        with pytest.raises(BaseException, match=f"{Unauthenticated.__name__}: .*wrong token"):
            dcp.save({"w": torch.zeros(5)}, storage_writer=bad)
    finally:
        server.stop()
    got = {"w": torch.zeros(5)}
    dcp.load(got, storage_reader=StorageReader(job))  # storage alone: no coordinator needed
    assert torch.equal(got["w"], torch.arange(5.0))


def test_import_ckpt_imports_no_integration() -> None:
    code = (
        "import sys, ckpt; "
        "bad = [m for m in ('ckpt.integrations', 'lightning', 'accelerate', "
        "'pytorch_lightning') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.filterwarnings(NO_DIST)
def test_dcp_load_falls_back_to_an_older_step_through_the_load_policy(
    tmp_path: Path, tally
) -> None:
    """ckpt.integrations.dcp.load: the newest step is damaged (a flipped byte in a shard),
    so it is quarantined and the step before it is loaded, whole; a StorageReader of the
    damaged step alone still fails, and an explicit step does not fall back."""
    from ckpt.integrations.dcp import load

    job = tmp_path / "run"
    for step in (1, 2):
        sd = {"w": torch.full((4096,), float(step)), "n": step}
        dcp.save(sd, storage_writer=StorageWriter(job, step=step), no_dist=True)
    shard = step_dir(job, 2) / "shards" / "rank-00000.bin"
    index = json.loads((step_dir(job, 2) / "shards" / "rank-00000.json").read_text())
    entry = next(e for e in index["entries"] if e["key"] == "w")
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 100] ^= 0x01
    shard.write_bytes(bytes(data))
    tally.fault("dcp load of a step with a flipped shard byte falls back to the older step")
    from ckptd.errors import HashMismatch

    with pytest.raises(HashMismatch, match="rank-00000.bin: key 'w'"):  # unwrapped from DCP's
        load({"w": torch.zeros(4096), "n": 0}, job, step=2)  # CheckpointException
    assert not (step_dir(job, 2) / "QUARANTINED.json").exists()  # an explicit step marks nothing
    got = {"w": torch.zeros(4096), "n": 0}
    assert load(got, job) == 1
    assert torch.equal(got["w"], torch.full((4096,), 1.0)) and got["n"] == 1
    assert (step_dir(job, 2) / "QUARANTINED.json").exists()
    # the quarantined step is skipped from now on; the reader's newest is step 1
    again = {"w": torch.zeros(4096), "n": 0}
    dcp.load(again, storage_reader=StorageReader(job), no_dist=True)
    assert again["n"] == 1
