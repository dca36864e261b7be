"""Tampering that keeps every hash in storage consistent is caught by the catalog.

An attacker (or a buggy tool) with write access to storage changes a tensor, re-hashes
its blocks into the shard index and records the index's new digest in MANIFEST.json:
storage alone now describes a valid checkpoint, and storage-only checks pass (that is the
documented limit of embedded / no-catalog use, asserted here so the docs stay true). The
coordinator's catalog holds the blake3 of the manifest it committed, so `ckptctl verify
--coordinator` and `Checkpointer.load` refuse the step, and a load without a step falls
back to the untouched one. See docs/security.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_testutil import (
    edit_index,
    edit_manifest,
    entry,
    index_path,
    read_json,
    shard_path,
    step_path,
    write_index_consistently,
)
from coordinator_fixtures import TOKEN, ServerThread, ckptctl, finished

import ckpt
from ckptd.format import hashing
from ckptd.server import ServerOptions

pytestmark = pytest.mark.timeout(120)
KEY = "w"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "CKPTD_ADDRESS", "CKPTD_TOKEN", "CKPT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)


def state(step: int) -> dict[str, Any]:
    return {KEY: torch.arange(2048, dtype=torch.float32) * step, "step": step}


@pytest.fixture
def saved(tmp_path: Path) -> Any:
    """A served root with steps 1 and 2 of one job, committed through the coordinator."""
    root = tmp_path / "root"
    server = ServerThread(root, options=ServerOptions(token=TOKEN))
    job = str(root / "job")
    try:
        with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a") as cp:
            for step in (1, 2):
                finished(cp.save(state(step), step))
        yield server, job
    finally:
        server.stop(0.2)


def rewrite_consistently(job: str, step: int) -> None:
    """Change the tensor's bytes; fix block hashes, index digest and size: all consistent."""
    e = entry(job, step, KEY)
    with open(shard_path(job, step), "r+b") as f:
        f.seek(e["offset"])
        f.write(b"\x00" * 16)  # the first four floats become 0.0
        f.seek(e["offset"])
        data = f.read(e["length"])
    block = read_json(step_path(job, step) + "/MANIFEST.json")["block_size"]
    doc = read_json(index_path(job, step))
    for d in doc["entries"]:
        if d["key"] == KEY:
            d["blake3"] = hashing.hash_blocks(memoryview(data), block)
    write_index_consistently(job, step, json.dumps(doc, separators=(",", ":")).encode())


def verify(job: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    rc, out, err = ckptctl("verify", job, "--json", *extra)
    return rc, json.loads(out), err


def test_consistent_rewrite_is_caught_by_the_catalog(saved, tally):
    server, job = saved
    with tally.bad_input("tamper:consistent-rewrite"):
        rewrite_consistently(job, 2)

        # Storage alone cannot tell (docs/security.md, "not protected").
        rc, doc, _ = verify(job, "--step", "2")
        assert rc == 0 and doc["ok"], doc
        forged = ckpt.load({}, job, step=2).state[KEY]
        assert forged[:4].eq(0).all() and not torch.equal(forged, state(2)[KEY])

        # The catalog can: ckptctl verify --coordinator.
        coord = ("--coordinator", server.address, "--token", TOKEN)
        rc, doc, _ = verify(job, "--all", *coord)
        assert rc == 1
        by_step = {r["step"]: r for r in doc["steps"]}
        assert by_step[1]["ok"] and not by_step[2]["ok"], doc
        [problem] = by_step[2]["problems"]
        assert "MANIFEST.json" in problem and "catalog" in problem and "rewritten" in problem
        rc, out, err = ckptctl("verify", job, "--step", "2", *coord)
        assert rc == 1 and "rewritten after its commit" in out + err

        # And a load through the coordinator: refused by step, skipped without one.
        with ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a") as cp:
            with pytest.raises(ckpt.CorruptCheckpoint, match="rewritten after its commit"):
                cp.load({}, step=2)
            res = cp.load({})
            assert res.step == 1 and res.fell_back_from == 2 and res.quarantined == [2]
            assert torch.equal(res.state[KEY], state(1)[KEY])
        info = {i.step: i.status for i in server.core.list_checkpoints(job)}
        assert info == {1: "COMMITTED", 2: "QUARANTINED"}


def test_untouched_steps_pass_catalog_verify(saved):
    server, job = saved
    rc, doc, err = verify(job, "--all", "--coordinator", server.address, "--token", TOKEN)
    assert rc == 0, (doc, err)
    assert [r["step"] for r in doc["steps"]] == [1, 2]
    # The digests the check compares with, as `ckptctl list --coordinator` shows them.
    rc, out, err = ckptctl("list", job, "--coordinator", server.address, "--token", TOKEN, "--json")
    assert rc == 0, err
    for row in json.loads(out)["steps"]:
        manifest = Path(step_path(job, row["step"])) / "MANIFEST.json"
        assert row["manifest_blake3"] == hashing.digest(manifest.read_bytes())


def test_forged_step_unknown_to_the_catalog(saved, tally):
    """A whole new step made by copying one: consistent in storage, unknown to the catalog."""
    server, job = saved
    with tally.bad_input("tamper:forged-step"):
        shutil.copytree(step_path(job, 2), step_path(job, 3))
        edit_manifest(job, 3, lambda m: m.__setitem__("step", 3))
        edit_index(job, 3, lambda d: d.__setitem__("step", 3))
        assert verify(job, "--step", "3")[0] == 0  # storage alone: a fine step 3
        rc, doc, _ = verify(job, "--step", "3", "--coordinator", server.address, "--token", TOKEN)
        assert rc == 1
        assert "not in the catalog" in doc["steps"][0]["problems"][0]


def test_verify_coordinator_needs_the_token(saved, tally):
    server, job = saved
    with tally.bad_input("auth:wrong-token"):
        rc, out, err = ckptctl("verify", job, "--coordinator", server.address, "--token", "nope")
        assert rc == 1 and "wrong token" in err


def test_load_does_not_need_the_coordinator_up(saved, caplog):
    """Storage alone restores (promise 6): with the coordinator gone the catalog check is
    skipped, with a warning, and the load still verifies every byte."""
    server, job = saved
    cp = ckpt.Checkpointer(job, coordinator=server.address, token=TOKEN, attempt="a")
    try:
        server.stop(0.2)
        cp.client.retry_for_s, cp.client.call_timeout_s = 0.2, 1.0
        res = cp.load({}, step=2)
        assert torch.equal(res.state[KEY], state(2)[KEY])
        assert "unreachable" in caplog.text and "storage's word alone" in caplog.text
    finally:
        cp.close()
