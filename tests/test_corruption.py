"""The corruption matrix: every kind of damage to a committed step is detected, by
`ckptctl verify` and by `ckpt.load`, and the step before it still loads bit for bit.

Steps 1 and 2 are saved with a 4 KiB hash block, so the main tensor spans three blocks
and a flipped bit can be placed in the first, a middle or the last block cheaply. Then
step 2 is damaged in one way per case.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import (
    assert_same,
    entry,
    flip_bit,
    index_path,
    read_json,
    shard_path,
    tensor_raw,
    write_bytes,
)

import ckpt
from ckptd import knobs
from ckptd.format import hashing

BLOCK = 4096
KEY = "layer.weight"  # 3000 float32 = 12000 bytes = 3 blocks of 4096
SMALL = "layer.bias"


def bin_name(job: str, step: int = 2) -> str:
    """Rank 0's shard file of `step` (a save's generation is part of its name)."""
    return os.path.basename(shard_path(job, step))


def idx_name(job: str, step: int = 2) -> str:
    return os.path.basename(index_path(job, step))


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        KEY: torch.randn(3000, generator=g),
        SMALL: torch.randn(7, generator=g),
        "emb": torch.randint(0, 1000, (4, 5), generator=g),
        "meta": {"step": step, "name": f"run-{step}"},
    }


def save_steps(job: str, *steps: int) -> dict[int, dict[str, Any]]:
    states = {}
    with knobs.override(block_size=BLOCK):
        for s in steps:
            states[s] = make_state(s)
            ckpt.save(states[s], job, step=s)
    return states


@pytest.fixture
def two_steps(job: str) -> dict[int, dict[str, Any]]:
    return save_steps(job, 1, 2)


# ----------------------------------------------------------------------------- the damage
# Each returns (the file a report must name, the key it must name or None, the error class,
# the byte offset inside KEY that was damaged or None).


def flip_in(key: str, where: Callable[[dict], int]) -> Callable[[str], tuple]:
    def corrupt(job: str) -> tuple:
        name = bin_name(job)
        e = entry(job, 2, key)
        pos = where(e)
        flip_bit(shard_path(job, 2), e["offset"] + pos, bit=3)
        return name, key, ckpt.HashMismatch, (key, pos)

    return corrupt


def truncate_one(job: str) -> tuple:
    name = bin_name(job)
    p = shard_path(job, 2)
    os.truncate(p, os.path.getsize(p) - 1)
    return name, None, ckpt.ShardSizeMismatch, None


def zero_length(job: str) -> tuple:
    name = bin_name(job)
    os.truncate(shard_path(job, 2), 0)
    return name, None, ckpt.ShardSizeMismatch, None


def append_byte(job: str) -> tuple:
    name = bin_name(job)
    with open(shard_path(job, 2), "ab") as f:
        f.write(b"\0")
    return name, None, ckpt.ShardSizeMismatch, None


def delete_shard(job: str) -> tuple:
    name = bin_name(job)
    os.unlink(shard_path(job, 2))
    return name, None, ckpt.ShardMissing, None


def delete_index(job: str) -> tuple:
    name = idx_name(job)
    os.unlink(index_path(job, 2))
    return name, None, ckpt.ShardMissing, None


def index_from_other_step(job: str) -> tuple:
    name = idx_name(job)
    shutil.copyfile(index_path(job, 1), index_path(job, 2))
    return name, None, ckpt.CorruptCheckpoint, None


def index_edited(job: str) -> tuple:
    name = idx_name(job)
    doc = read_json(index_path(job, 2))
    doc["entries"][0]["blake3"][0] = "0" * 64
    write_bytes(index_path(job, 2), json.dumps(doc).encode())
    return name, None, ckpt.CorruptCheckpoint, None


def consistent_rewrite(job: str) -> tuple:
    """Change the data and re-hash it into the index: only the manifest's index hash knows."""
    name = idx_name(job)
    e = entry(job, 2, KEY)
    flip_bit(shard_path(job, 2), e["offset"] + 5, bit=0)
    with open(shard_path(job, 2), "rb") as f:
        f.seek(e["offset"])
        data = f.read(e["length"])
    doc = read_json(index_path(job, 2))
    for d in doc["entries"]:
        if d["key"] == KEY:
            d["blake3"] = hashing.hash_blocks(memoryview(data), BLOCK)
    write_bytes(index_path(job, 2), json.dumps(doc, separators=(",", ":")).encode())
    return name, None, ckpt.CorruptCheckpoint, None


CASES = {
    "flip-first-byte": flip_in(KEY, lambda e: 0),
    "flip-middle-block": flip_in(KEY, lambda e: e["length"] // 2),
    "flip-block-boundary": flip_in(KEY, lambda e: BLOCK),
    "flip-last-byte": flip_in(KEY, lambda e: e["length"] - 1),
    "flip-small-entry": flip_in(SMALL, lambda e: 3),
    "flip-int-entry-last": flip_in("emb", lambda e: e["length"] - 1),
    "truncate-one-byte": truncate_one,
    "zero-length-shard": zero_length,
    "appended-byte": append_byte,
    "deleted-shard": delete_shard,
    "deleted-index": delete_index,
    "index-from-other-step": index_from_other_step,
    "index-edited": index_edited,
    "consistent-rewrite-of-shard-and-index": consistent_rewrite,
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_corruption_is_detected(job, two_steps, ckptctl, tally, case):
    # Sanity: both steps are whole before the damage.
    assert ckptctl("verify", job, "--all")[0] == 0

    kind = "tamper:consistent-rewrite" if case.startswith("consistent") else f"corruption:{case}"
    with tally.bad_input(kind):
        fname, key, err_type, damaged = CASES[case](job)

        # ckptctl verify: exit 1, names the file (and the key for data damage).
        rc, out, err = ckptctl("verify", job, "--step", "2")
        assert rc == 1, (out, err)
        assert fname in out + err
        if key is not None:
            assert repr(key) in out + err or key in out + err

        rc, out, err = ckptctl("verify", job, "--step", "2", "--json")
        assert rc == 1
        doc = json.loads(out)
        assert doc["ok"] is False
        [report] = doc["steps"]
        assert report["step"] == 2 and report["ok"] is False
        assert report["problems"] and any(fname in p for p in report["problems"])
        if key is not None:
            assert any(key in p for p in report["problems"])

        # ckpt.load, explicit step and newest without fallback: raises, names the file and key.
        for kwargs in ({"step": 2}, {"fallback": False}):
            with pytest.raises(ckpt.CorruptCheckpoint) as ei:
                ckpt.load({}, job, **kwargs)
            assert isinstance(ei.value, err_type), type(ei.value)
            assert fname in str(ei.value)
            if key is not None:
                assert key in str(ei.value)

        # The damaged block never reaches the caller's memory.
        if damaged is not None:
            dkey, pos = damaged
            target = {
                k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
                for k, v in two_steps[2].items()
            }
            with pytest.raises(ckpt.HashMismatch):
                ckpt.load(target, job, step=2)
            raw = np.frombuffer(tensor_raw(target[dkey]), dtype=np.uint8)
            lo = pos - pos % BLOCK
            assert not raw[lo : lo + BLOCK].any(), (
                "bytes of the corrupt block were copied into the state"
            )

        # The step before is untouched: verifies and loads bit for bit.
        rc, out, err = ckptctl("verify", job, "--step", "1")
        assert rc == 0, (out, err)
        assert_same(ckpt.load({}, job, step=1).state, two_steps[1])

        # The newest, with fallback (the default): step 1 is loaded, step 2 quarantined, loudly.
        lr = ckpt.load({}, job)
        assert lr.step == 1 and lr.fell_back_from == 2 and lr.quarantined == [2]
        assert lr.fallback_reason is not None and fname in lr.fallback_reason
        if key is not None:
            assert key in lr.fallback_reason
        assert_same(lr.state, two_steps[1])
        rc, out, _ = ckptctl("list", job, "--json")
        assert [(s["step"], s["status"]) for s in json.loads(out)["steps"]] == [
            (1, "COMMITTED"),
            (2, "QUARANTINED"),
        ]

        # --all sees both.
        rc, out, _ = ckptctl("verify", job, "--all", "--json")
        assert rc == 1
        by_step = {r["step"]: r["ok"] for r in json.loads(out)["steps"]}
        assert by_step == {1: True, 2: False}


def test_swapped_shards_of_two_steps(job, ckptctl):
    states = save_steps(job, 1, 2, 3)
    a, b = shard_path(job, 2), shard_path(job, 3)
    assert os.path.getsize(a) == os.path.getsize(b)
    tmp = a + ".swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    for step in (2, 3):
        rc, out, err = ckptctl("verify", job, "--step", str(step))
        assert rc == 1
        assert bin_name(job, step) in out + err
        with pytest.raises(ckpt.HashMismatch) as ei:
            ckpt.load({}, job, step=step)
        assert bin_name(job, step) in str(ei.value) and f"step-{step:012d}" in str(ei.value)
    assert_same(ckpt.load({}, job, step=1).state, states[1])
    rc, out, _ = ckptctl("verify", job, "--all", "--json")
    assert rc == 1
    assert {r["step"]: r["ok"] for r in json.loads(out)["steps"]} == {1: True, 2: False, 3: False}


def test_unreadable_manifest_of_the_newest_step(job, two_steps, ckptctl):
    """A garbled MANIFEST.json: that step is refused by name; resume uses the newest whole one."""
    mpath = os.path.join(os.path.dirname(os.path.dirname(shard_path(job, 2))), "MANIFEST.json")
    with open(mpath, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ckpt.InvalidManifest, match="MANIFEST.json"):
        ckpt.load({}, job, step=2)
    rc, out, err = ckptctl("verify", job, "--step", "2")
    assert rc == 1 and "MANIFEST.json" in out + err
    rc, out, _ = ckptctl("verify", job, "--all", "--json")
    assert rc == 1
    assert {r["step"]: r["ok"] for r in json.loads(out)["steps"]} == {1: True, 2: False}
    rc, out, _ = ckptctl("list", job, "--json")
    assert [(s["step"], s["status"]) for s in json.loads(out)["steps"]] == [
        (1, "COMMITTED"),
        (2, "INVALID"),
    ]
    lr = ckpt.load({}, job)
    assert lr.step == 1
    assert_same(lr.state, two_steps[1])


def test_every_problem_is_reported_not_just_the_first(job, two_steps, ckptctl):
    flip_in(KEY, lambda e: 0)(job)
    flip_in(SMALL, lambda e: 0)(job)
    rc, out, _ = ckptctl("verify", job, "--step", "2", "--json")
    assert rc == 1
    problems = json.loads(out)["steps"][0]["problems"]
    assert any(KEY in p for p in problems) and any(SMALL in p for p in problems)


def test_flip_in_alignment_padding_is_harmless(job, two_steps, ckptctl):
    """Padding between entries carries no data: the tensors still load exactly."""
    e = entry(job, 2, SMALL)
    flip_bit(shard_path(job, 2), e["offset"] + e["length"], bit=0)
    assert_same(ckpt.load({}, job, step=2).state, two_steps[2])


def test_size_level_checks_sizes_only(job, two_steps, ckptctl):
    flip_in(KEY, lambda e: 0)(job)
    assert ckptctl("verify", job, "--step", "2", "--level", "size")[0] == 0
    assert ckptctl("verify", job, "--step", "2", "--level", "full")[0] == 1
    truncate_one(job)
    rc, out, err = ckptctl("verify", job, "--step", "2", "--level", "size", "--json")
    assert rc == 1
    assert json.loads(out)["steps"][0]["level"] == "size"


# ----------------------------------------------------------------------------- clean runs


def test_verify_clean_checkpoint(job, two_steps, run_ckptctl):
    """The real entry point (python -m ckptd.cli.ckptctl) on a whole job: exit 0."""
    rc, out, err = run_ckptctl("verify", job, "--all", "--json")
    assert rc == 0, (out, err)
    doc = json.loads(out)
    assert doc["ok"] is True
    assert [r["step"] for r in doc["steps"]] == [1, 2]
    for r in doc["steps"]:
        assert r["ok"] is True and r["problems"] == [] and r["level"] == "full"
        assert r["bytes_checked"] == os.path.getsize(shard_path(job, r["step"]))


def test_verify_corrupt_checkpoint_real_process(job, two_steps, run_ckptctl):
    flip_in(KEY, lambda e: 100)(job)
    rc, out, err = run_ckptctl("verify", job, "--all")
    assert rc == 1
    assert bin_name(job) in out + err and KEY in out + err


def test_verify_clean_in_process(job, two_steps, ckptctl):
    rc, out, err = ckptctl("verify", job)
    assert rc == 0, (out, err)
    rc, out, _ = ckptctl("verify", job, "--step", "1", "--json")
    assert rc == 0
    [r] = json.loads(out)["steps"]
    assert r["step"] == 1 and r["ok"] is True


def test_verify_missing_or_empty(tmp_path, ckptctl):
    rc, _, _ = ckptctl("verify", str(tmp_path / "nope"))
    assert rc == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckptctl("verify", str(empty))[0] == 1
    rc, out, _ = ckptctl("verify", str(empty), "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


def test_verify_step_that_does_not_exist(job, two_steps, ckptctl):
    rc, out, _ = ckptctl("verify", job, "--step", "7", "--json")
    assert rc == 1
    assert json.loads(out)["ok"] is False


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["verify"],
        ["frobnicate", "{job}"],
        ["verify", "{job}", "--step", "1", "--all"],
        ["verify", "{job}", "--level", "bogus"],
        ["verify", "{job}", "--step", "one"],
        ["verify", "{job}", "--no-such-flag"],
        ["gc", "{job}", "--keep-last", "0"],
    ],
    ids=[
        "nothing",
        "no-path",
        "unknown-command",
        "step-and-all",
        "bad-level",
        "bad-step",
        "bad-flag",
        "keep-zero",
    ],
)
def test_usage_errors_exit_2(job, two_steps, ckptctl, argv):
    rc, out, err = ckptctl(*[a.format(job=job) for a in argv])
    assert rc == 2, (out, err)


def test_usage_error_exit_2_real_process(job, run_ckptctl):
    rc, out, err = run_ckptctl("verify", job, "--level", "bogus")
    assert rc == 2
    assert "usage" in err.lower()


def test_list_and_inspect(job, two_steps, ckptctl):
    rc, out, _ = ckptctl("list", job, "--json")
    assert rc == 0
    steps = json.loads(out)["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [(1, "COMMITTED"), (2, "COMMITTED")]
    rc, out, _ = ckptctl("inspect", job, "--step", "1", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["step"] == 1
    assert {t["key"] for t in doc["tensors"]} == {KEY, SMALL, "emb"}
    rc, out, _ = ckptctl("inspect", job)
    assert rc == 0 and KEY in out
