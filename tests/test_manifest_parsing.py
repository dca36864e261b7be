"""Crafted manifests and shard indexes are refused before any tensor memory is allocated.

Each case starts from a real checkpoint, edits MANIFEST.json or the shard index, and
expects `open_checkpoint` (which parses and cross-checks everything, and allocates no
tensor) and `ckpt.load` to raise InvalidManifest / UnsafePath / another CorruptCheckpoint.
Index edits rewrite the manifest's index_size and index_blake3 too, so that the parser,
not the hash check, is what must reject them.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import (
    as_fresh_process,
    assert_same,
    edit_index,
    edit_manifest,
    index_path,
    manifest_path,
    read_json,
    shard_path,
    step_path,
    write_bytes,
    write_index_consistently,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckptd import knobs
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing
from ckptd.format.manifest import parse_index, parse_manifest
from ckptd.storage import open_storage

REJECTED = (ckpt.InvalidManifest, ckpt.UnsafePath, ckpt.CorruptCheckpoint)


def make_state() -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.ones(3, dtype=torch.bfloat16),
        "plain": {"lr": 0.5, "name": "x"},
    }


@pytest.fixture
def saved(job: str) -> dict[str, Any]:
    state = make_state()
    ckpt.save(state, job, step=1)
    return state


# The reliability report's kind for each test's bad inputs (tests/tally.py).
TALLY_KINDS = {
    "test_unsafe_shard_and_index_paths": "path-traversal",
    "test_unsafe_entry_file": "path-traversal",
    "test_entry_file_pointing_at_another_shard": "path-traversal",
    "test_traversal_is_refused_before_anything_outside_is_touched": "path-traversal",
    "test_bad_index_entries": "manifest-bomb",
    "test_entry_past_end_of_shard": "manifest-bomb",
    "test_overlapping_entries": "manifest-bomb",
    "test_duplicate_key_in_index": "manifest-bomb",
    "test_too_many_entries": "manifest-bomb",
    "test_oversized_json": "manifest-bomb",
    "test_deeply_nested_json": "manifest-bomb",
    "test_state_nested_past_the_node_limit": "manifest-bomb",
    "test_declared_sizes_not_the_file_sizes": "manifest-bomb",
}
_tally: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _count_bad_inputs(request: pytest.FixtureRequest, tally: Any) -> Any:
    _tally.update(tally=tally, kind=TALLY_KINDS.get(request.node.originalname, "manifest-field"))
    yield
    _tally.clear()


def bad_input(kind: str | None = None) -> Any:
    """A tally block for one bad input of this test (kind from TALLY_KINDS by default)."""
    return _tally["tally"].bad_input(kind or _tally["kind"])


def expect_rejected(
    job: str, kind: type | tuple[type, ...] = REJECTED, match: str | None = None
) -> str:
    """Both the parser-level open and ckpt.load refuse step 1; returns the message."""
    with bad_input():
        with pytest.raises(kind) as ei:
            ckfmt.open_checkpoint(open_storage(job), 1)
        msg = str(ei.value)
        if match is not None:
            assert match in msg, msg
        with pytest.raises(kind):
            ckpt.load({}, job, step=1)
    return msg


def read_raw(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def shard0(m: dict) -> dict:
    return m["shards"][0]


def entry0(doc: dict) -> dict:
    return doc["entries"][0]


UNSAFE_PATHS = {
    "dotdot": "../outside.bin",
    "dotdot-inside": "shards/../../outside.bin",
    "absolute": "/etc/passwd",
    "nul": "shards/rank-00000.bin\x00.txt",
    "overlong": "shards/" + "a" * 2000,
    "empty": "",
    "dot": "./shards/rank-00000.bin",
    "double-slash": "shards//rank-00000.bin",
    "backslash": "shards\\rank-00000.bin",
    "not-a-string": 7,
    "unicode-component": "shards/ränk.bin",
}


# ----------------------------------------------------------------------------- paths


@pytest.mark.parametrize("bad", list(UNSAFE_PATHS.values()), ids=list(UNSAFE_PATHS))
@pytest.mark.parametrize("field", ["path", "index"])
def test_unsafe_shard_and_index_paths(job, saved, field, bad):
    edit_manifest(job, 1, lambda m: shard0(m).__setitem__(field, bad))
    expect_rejected(job, (ckpt.UnsafePath, ckpt.InvalidManifest))


@pytest.mark.parametrize("bad", list(UNSAFE_PATHS.values()), ids=list(UNSAFE_PATHS))
def test_unsafe_entry_file(job, saved, bad):
    edit_index(job, 1, lambda d: entry0(d).__setitem__("file", bad))
    expect_rejected(job, (ckpt.UnsafePath, ckpt.InvalidManifest))


def test_entry_file_pointing_at_another_shard(job, saved):
    edit_index(job, 1, lambda d: entry0(d).__setitem__("file", "shards/rank-00001.bin"))
    expect_rejected(job, ckpt.InvalidManifest, match="rank-00001.bin")


def test_traversal_is_refused_before_anything_outside_is_touched(job, saved, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * os.path.getsize(shard_path(job, 1)))
    rel = os.path.relpath(secret, step_path(job, 1))
    assert rel.startswith("..")
    edit_manifest(job, 1, lambda m: shard0(m).__setitem__("path", rel))
    expect_rejected(job, ckpt.UnsafePath)
    assert secret.read_bytes() == b"\0" * os.path.getsize(shard_path(job, 1))


# ----------------------------------------------------------------------------- shapes


def _set(**fields: Any) -> Callable[[dict], None]:
    def fn(d: dict) -> None:
        entry0(d).update(fields)

    return fn


SHAPE_CASES = {
    "product-overflows-2**62": dict(
        shape=[2**61, 4, 3], chunk_sizes=[2**61, 4, 3], chunk_offsets=[0, 0, 0]
    ),
    "product-overflows-int64": dict(
        shape=[2**40, 2**40], chunk_sizes=[2**40, 2**40], chunk_offsets=[0, 0]
    ),
    "dim-2**62": dict(shape=[2**62], chunk_sizes=[2**62], chunk_offsets=[0]),
    "dim-2**64": dict(shape=[2**64], chunk_sizes=[2**64], chunk_offsets=[0]),
    "global-shape-only-huge": dict(shape=[2**61, 2**61], chunk_sizes=[3, 4], chunk_offsets=[0, 0]),
    "negative-dim": dict(shape=[-3, -4], chunk_sizes=[-3, -4]),
    "bool-dim": dict(shape=[True, 4], chunk_sizes=[True, 4]),
    "float-dim": dict(shape=[3.0, 4], chunk_sizes=[3.0, 4]),
    "string-dim": dict(shape=["3", 4], chunk_sizes=["3", 4]),
    "shape-not-list": dict(shape=12),
    "too-many-dims": dict(shape=[1] * 65, chunk_sizes=[1] * 65, chunk_offsets=[0] * 65),
    "ranks-differ": dict(chunk_offsets=[0]),
    "chunk-outside-tensor": dict(chunk_offsets=[1, 0]),
    "length-not-numel-x-itemsize": dict(length=47),
    "length-zero": dict(length=0, blake3=[]),
    "length-bool": dict(length=True),
    "length-negative": dict(length=-48),
    "offset-unaligned": dict(offset=8),
    "offset-bool": dict(offset=False),
    "offset-float": dict(offset=0.0),
    "offset-negative": dict(offset=-4096),
    "offset-past-end": dict(offset=1 << 40),
    "dtype-unknown": dict(dtype="float128"),
    "dtype-object": dict(dtype="object"),
    "dtype-not-string": dict(dtype=4),
    "blake3-missing-block": dict(blake3=[]),
    "blake3-extra-block": dict(blake3=["0" * 64, "0" * 64]),
    "blake3-not-hex": dict(blake3=["z" * 64]),
    "blake3-short": dict(blake3=["0" * 63]),
    "blake3-uppercase": dict(blake3=["A" * 64]),
    "blake3-whitespace": dict(blake3=["0" * 62 + "  "]),
    "blake3-not-string": dict(blake3=[["0"] * 64]),
    "blake3-object": dict(blake3=[{f"{i:02x}": 0 for i in range(64)}]),
    "blake3-non-ascii": dict(blake3=["0" * 63 + "\u00e9"]),
    "key-empty": dict(key=""),
    "key-nul": dict(key="w\x00"),
    "key-not-string": dict(key=["w"]),
}


@pytest.mark.parametrize("fields", list(SHAPE_CASES.values()), ids=list(SHAPE_CASES))
def test_bad_index_entries(job, saved, fields):
    assert read_json(index_path(job, 1))["entries"][0]["key"] == "w"
    edit_index(job, 1, _set(**fields))
    expect_rejected(job, (ckpt.InvalidManifest, ckpt.UnsafePath))


def test_an_entry_error_names_the_index_file_and_the_entry(job, saved):
    edit_index(job, 1, _set(length=47))
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "rank-00000.json" in msg and "key 'w'" in msg and "length 47" in msg, msg
    edit_index(job, 1, _set(key=7))  # no key to name: its place in the index instead
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "rank-00000.json" in msg and "entry #0" in msg and "'key'" in msg, msg


def test_entry_past_end_of_shard(job, saved):
    size = os.path.getsize(shard_path(job, 1))
    edit_index(job, 1, _set(offset=size))
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "past" in msg


def test_overlapping_entries(job, saved):
    def overlap(d: dict) -> None:
        d["entries"][1]["offset"] = d["entries"][0]["offset"]

    edit_index(job, 1, overlap)
    assert "overlap" in expect_rejected(job, ckpt.InvalidManifest)


def test_duplicate_key_in_index(job, saved):
    def dup(d: dict) -> None:
        d["entries"][1]["key"] = d["entries"][0]["key"]

    edit_index(job, 1, dup)
    expect_rejected(job, ckpt.InvalidManifest)


def test_one_box_of_a_key_twice_in_an_index(job, saved):
    """A shard may hold several chunks of one key (DCP: several local shards), each box once."""

    def dup(d: dict) -> None:
        for field in ("key", "dtype", "shape", "chunk_offsets", "chunk_sizes", "length"):
            d["entries"][1][field] = d["entries"][0][field]

    edit_index(job, 1, dup)
    assert "appears twice in one shard" in expect_rejected(job, ckpt.InvalidManifest)


def test_too_many_entries(job, saved):
    with knobs.override(max_entries_per_shard=2):
        msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "limit" in msg
    # Within the limit it loads.
    with knobs.override(max_entries_per_shard=3):
        assert_same(ckpt.load({}, job).state, saved)


@pytest.mark.parametrize(
    "field, value",
    [
        ("size", 0),
        ("size", 2**62),
        ("size", "file+1"),
        ("size", "file-4096"),
        ("index_size", 0),
        ("index_size", 2**40),
        ("index_size", "file+1"),
    ],
)
def test_declared_sizes_not_the_file_sizes(job, saved, field, value):
    """The manifest's sizes are checked against the files before anything is read or
    allocated; a declared 2**62-byte shard allocates nothing."""
    path = shard_path(job, 1) if field == "size" else index_path(job, 1)
    if isinstance(value, str):
        value = os.path.getsize(path) + int(value[len("file") :])
    edit_manifest(job, 1, lambda m: shard0(m).__setitem__(field, value))
    expect_rejected(job, ckpt.CorruptCheckpoint)


# ----------------------------------------------------------------------------- manifest fields


def in_place(fn: Callable[[dict], Any]) -> Callable[[dict], Any]:
    def edit(m: dict) -> dict:
        fn(m)
        return m

    return edit


def second_shard(m: dict, rank: int) -> dict:
    return dict(shard0(m), rank=rank, path="shards/rank-00001.bin", index="shards/rank-00001.json")


MANIFEST_CASES: dict[str, Callable[[dict], Any]] = {
    "step-bool": in_place(lambda m: m.__setitem__("step", True)),
    "step-other": in_place(lambda m: m.__setitem__("step", 2)),
    "step-negative": in_place(lambda m: m.__setitem__("step", -1)),
    "step-string": in_place(lambda m: m.__setitem__("step", "1")),
    "generation-bool": in_place(lambda m: m.__setitem__("generation", False)),
    "generation-negative": in_place(lambda m: m.__setitem__("generation", -1)),
    "world-size-zero": in_place(lambda m: m.__setitem__("world_size", 0)),
    "world-size-bool": in_place(lambda m: m.__setitem__("world_size", True)),
    "block-size-tiny": in_place(lambda m: m.__setitem__("block_size", 16)),
    "alignment-not-power-of-2": in_place(lambda m: m.__setitem__("alignment", 3000)),
    "shard-size-bool": in_place(lambda m: shard0(m).__setitem__("size", True)),
    "shard-size-negative": in_place(lambda m: shard0(m).__setitem__("size", -1)),
    "shard-size-wrong": in_place(lambda m: shard0(m).__setitem__("size", shard0(m)["size"] + 4096)),
    "index-size-wrong": in_place(
        lambda m: shard0(m).__setitem__("index_size", shard0(m)["index_size"] - 1)
    ),
    "index-blake3-wrong": in_place(lambda m: shard0(m).__setitem__("index_blake3", "0" * 64)),
    "index-blake3-not-hex": in_place(lambda m: shard0(m).__setitem__("index_blake3", "g" * 64)),
    "rank-bool": in_place(lambda m: shard0(m).__setitem__("rank", False)),
    "rank-out-of-world": in_place(lambda m: shard0(m).__setitem__("rank", 1)),
    "duplicate-rank": in_place(lambda m: m["shards"].append(second_shard(m, rank=0))),
    "duplicate-rank-world-2": in_place(
        lambda m: (m.__setitem__("world_size", 2), m["shards"].append(second_shard(m, rank=0)))
    ),
    "duplicate-path": in_place(
        lambda m: (m.__setitem__("world_size", 2), m["shards"].append(dict(shard0(m), rank=1)))
    ),
    "shards-not-list": in_place(lambda m: m.__setitem__("shards", {"0": shard0(m)})),
    "shard-not-object": in_place(lambda m: m.__setitem__("shards", ["shards/rank-00000.bin"])),
    "missing-field": in_place(lambda m: shard0(m).pop("index_blake3")),
    "format-name": in_place(lambda m: m.__setitem__("format", "safetensors")),
    "hash-name": in_place(lambda m: m.__setitem__("hash", "sha1")),
    "metadata-not-object": in_place(lambda m: m.__setitem__("metadata", [])),
    "state-unknown-tag": in_place(lambda m: m.__setitem__("state", {"pickle": "gASV"})),
    "state-two-tags": in_place(lambda m: m.__setitem__("state", {"list": [], "tuple": []})),
    "state-missing-key": in_place(lambda m: m.__setitem__("state", {"tensor": "nope"})),
    "state-bad-base64": in_place(lambda m: m.__setitem__("state", {"bytes": "!!!"})),
    "state-bad-float": in_place(lambda m: m.__setitem__("state", {"float": "1e999"})),
    "state-dict-key-not-scalar": in_place(
        lambda m: m.__setitem__("state", {"dict": [[{"list": []}, 1]]})
    ),
    "state-dict-pair-triple": in_place(lambda m: m.__setitem__("state", {"dict": [["a", 1, 2]]})),
    "state-per-rank-old-shape": in_place(lambda m: m.__setitem__("state", {"per_rank": [0, 1]})),
    "state-per-rank-bool-rank": in_place(
        lambda m: m.__setitem__("state", {"per_rank": [[True, 1]]})
    ),
    "state-per-rank-negative-rank": in_place(
        lambda m: m.__setitem__("state", {"per_rank": [[-1, 1]]})
    ),
    "state-per-rank-not-list": in_place(lambda m: m.__setitem__("state", {"per_rank": {"0": 1}})),
    "top-level-list": lambda m: [m],
    "top-level-null": lambda m: None,
}


@pytest.mark.parametrize("mutate", list(MANIFEST_CASES.values()), ids=list(MANIFEST_CASES))
def test_bad_manifest_fields(job, saved, mutate):
    path = manifest_path(job, 1)
    doc = read_json(path)
    write_bytes(path, json.dumps(mutate(doc)).encode())
    expect_rejected(job)


def test_wrong_format_version_says_upgrade(job, saved):
    # 3, 4: incremental saves; 5: phased layouts; 6: newer than any read
    edit_manifest(job, 1, lambda m: m.__setitem__("version", 6))
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "upgrade" in msg.lower()
    assert "6" in msg


def test_index_with_wrong_version(job, saved):
    edit_index(job, 1, lambda d: d.__setitem__("version", 6))  # 4, 5: newer formats
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "upgrade" in msg.lower() and "6" in msg


@pytest.mark.parametrize(
    "field", ["step", "rank", "generation", "world_size", "shard", "shard_size", "block_size"]
)
def test_index_disagreeing_with_manifest(job, saved, field):
    def fn(d: dict) -> None:
        v = d[field]
        d[field] = v + 1 if isinstance(v, int) else "shards/other.bin"

    edit_index(job, 1, fn)
    expect_rejected(job, ckpt.InvalidManifest, match=field)


def test_manifest_copied_from_another_step(job, saved):
    ckpt.save(make_state(), job, step=2)
    shutil.copyfile(manifest_path(job, 1), manifest_path(job, 2))
    with pytest.raises(ckpt.InvalidManifest, match="another step"):
        ckfmt.open_checkpoint(open_storage(job), 2)


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ["manifest", "index"])
def test_non_standard_json_constants(job, saved, const, where):
    if where == "manifest":
        path = manifest_path(job, 1)
        text = read_raw(path).decode()
        text = text.replace('"created_unix":', f'"created_unix":{const},"_x":', 1)
        write_bytes(path, text.encode())
    else:
        text = read_raw(index_path(job, 1)).decode()
        text = text.replace('"generation":0', f'"generation":{const}', 1)
        write_index_consistently(job, 1, text.encode())
    assert (
        const
        in read_raw(manifest_path(job, 1) if where == "manifest" else index_path(job, 1)).decode()
    )
    expect_rejected(job, ckpt.InvalidManifest)


@pytest.mark.parametrize("where", ["manifest", "index"])
def test_oversized_json(job, saved, where):
    if where == "manifest":
        size = os.path.getsize(manifest_path(job, 1))
        with knobs.override(max_manifest_bytes=size - 1):
            assert "limit" in expect_rejected(job, ckpt.InvalidManifest)
        with knobs.override(max_manifest_bytes=size):
            ckpt.load({}, job)
    else:
        size = os.path.getsize(index_path(job, 1))
        with knobs.override(max_index_bytes=size - 1):
            expect_rejected(job, ckpt.CorruptCheckpoint)
        with knobs.override(max_index_bytes=size):
            ckpt.load({}, job)


def test_index_grown_past_recorded_size(job, saved):
    with open(index_path(job, 1), "ab") as f:
        f.write(b" " * 100)
    expect_rejected(job, ckpt.CorruptCheckpoint)


@pytest.mark.parametrize("depth", [100_000, 5_000])
@pytest.mark.parametrize("where", ["manifest", "index"])
def test_deeply_nested_json(job, saved, where, depth):
    bomb = "[" * depth + "]" * depth
    if where == "manifest":
        doc = read_json(manifest_path(job, 1))
        doc["metadata"] = {"x": "@@"}
        write_bytes(manifest_path(job, 1), json.dumps(doc).replace('"@@"', bomb).encode())
    else:
        doc = read_json(index_path(job, 1))
        doc["extra"] = "@@"
        write_index_consistently(job, 1, json.dumps(doc).replace('"@@"', bomb).encode())
    msg = expect_rejected(job, ckpt.InvalidManifest)
    assert "nested" in msg or "JSON" in msg


def test_state_nested_past_the_node_limit(job, saved):
    node: Any = 1
    for _ in range(400):
        node = {"list": [node]}
    edit_manifest(job, 1, lambda m: m.__setitem__("state", node))
    expect_rejected(job, ckpt.InvalidManifest)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe\x00garbage",
        b"{",
        b"[]",
        b"null",
        b'"ckptd"',
        b"{}",
        b"\x00" * 64,
        b'{"format":"ckptd"}',
    ],
    ids=[
        "empty",
        "binary",
        "truncated",
        "list",
        "null",
        "string",
        "empty-object",
        "zeros",
        "header-only",
    ],
)
def test_garbage_manifest(job, saved, data):
    write_bytes(manifest_path(job, 1), data)
    with pytest.raises(ckpt.InvalidManifest):
        parse_manifest(data)
    expect_rejected(job, ckpt.InvalidManifest)
    # Without an explicit step there is nothing valid left: not found, never a fresh start.
    with pytest.raises(ckpt.CheckpointNotFound):
        ckpt.load({}, job)


def test_truncated_manifest_names_file(job, saved):
    data = read_raw(manifest_path(job, 1))
    write_bytes(manifest_path(job, 1), data[: len(data) // 2])
    assert "MANIFEST.json" in expect_rejected(job, ckpt.InvalidManifest)


# ----------------------------------------------------------------------------- known bugs


def test_created_unix_huge_int(job, saved):
    edit_manifest(job, 1, lambda m: m.__setitem__("created_unix", 10**400))
    expect_rejected(job, ckpt.InvalidManifest)


@pytest.mark.parametrize("tag", ["ndarray", "npscalar"])
def test_ndarray_tag_on_torch_only_dtype(job, saved, tag):
    def retag(m: dict) -> None:
        for pair in m["state"]["dict"]:
            if pair[0] == "h":
                pair[1] = {tag: "h"}

    edit_manifest(job, 1, retag)
    with pytest.raises(ckpt.InvalidManifest):
        ckpt.load({}, job, step=1)


def test_one_entry_referenced_as_tensor_and_ndarray(job, saved):
    edit_manifest(job, 1, lambda m: m["state"]["dict"].append(["w2", {"ndarray": "w"}]))
    try:
        out = ckpt.load({}, job, step=1).state
    except ckpt.InvalidManifest:
        return
    assert torch.equal(out["w"], saved["w"])
    np.testing.assert_array_equal(out["w2"], saved["w"].numpy())


@pytest.mark.parametrize(
    "digest", [" " + "a" * 63, "0x" + "a" * 62, "a" + "_a" * 31 + "a", "١" * 64]
)
def test_index_blake3_must_be_lowercase_hex(saved, job, digest):
    assert len(digest) == 64
    doc = read_json(manifest_path(job, 1))
    shard0(doc)["index_blake3"] = digest
    with pytest.raises(ckpt.InvalidManifest):
        parse_manifest(json.dumps(doc).encode())


def test_a_state_tree_checked_once_per_manifest_bytes(saved, job, monkeypatch):
    """The tree's check is remembered by the manifest bytes' blake3 (a listing parses every
    kept step's manifest): the same bytes are not checked again, and any other bytes are,
    so an altered tree is refused after the intact one passed."""
    from ckptd.format import manifest as mf
    from ckptd.format import values

    calls = []
    check = values.check_node
    # Whole trees only (the check recurses through the module's name with a depth).
    monkeypatch.setattr(
        values, "check_node", lambda *a: (calls.append(1) if len(a) == 1 else None) or check(*a)
    )
    data = read_raw(manifest_path(job, 1))
    doc = json.loads(data)
    doc["job"] = doc["job"] + "-tree-check"  # bytes of our own, checked by no earlier test
    intact = json.dumps(doc).encode()
    assert parse_manifest(intact).state == parse_manifest(intact).state
    assert len(calls) == 1
    doc["state"]["dict"].append(["bad", {"unknown_tag": 1}])
    with bad_input():
        with pytest.raises(ckpt.InvalidManifest, match="unknown tag"):
            parse_manifest(json.dumps(doc).encode())
    assert len(calls) == 2
    # Bounded: the oldest verdict goes first.
    monkeypatch.setattr(mf._CHECKED_STATES, "limit", 1)
    doc["state"]["dict"].pop()
    parse_manifest(json.dumps({**doc, "job": "another"}).encode())
    parse_manifest(intact)
    assert len(calls) == 4 and len(mf._CHECKED_STATES) == 1


def test_the_live_line_reads_each_manifest_and_parses_new_bytes_only(saved, job, monkeypatch):
    """The head's lookup (a save without a parent, a load without a step) parses a step's
    manifest once per distinct bytes (read_lineage); the bytes are read every time, so a
    manifest damaged, replaced or copied into another step since is seen at once."""
    ckpt.save(make_state(), job, step=2)
    storage = open_storage(job)
    parsed = []
    parse = ckfmt.parse_manifest
    monkeypatch.setattr(ckfmt, "parse_manifest", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    assert ckfmt.latest_step(storage) == 2
    first = len(parsed)
    assert first <= 2  # none when an earlier listing in this process saw the same bytes
    assert ckfmt.latest_step(storage) == 2 and ckfmt.latest_step(storage) == 2
    assert len(parsed) == first
    # New bytes are parsed in full: a step 2 that no longer parses is no head.
    doc = read_json(manifest_path(job, 2))
    good = read_raw(manifest_path(job, 2))
    write_bytes(manifest_path(job, 2), json.dumps({**doc, "block_size": 3}).encode())
    with bad_input():
        steps = ckfmt.list_steps(storage, manifests=False)
        assert [s.status for s in steps] == [ckfmt.COMMITTED, ckfmt.INVALID]
        assert "block_size" in (steps[1].error or "") and "step-000000000002" in steps[1].error
        assert ckfmt.latest_step(storage) == 1
    assert len(parsed) == first + 2
    # Bytes already parsed, in another step's directory, are still refused there.
    write_bytes(manifest_path(job, 2), read_raw(manifest_path(job, 1)))
    with bad_input():
        steps = ckfmt.list_steps(storage, manifests=False)
        assert steps[1].status == ckfmt.INVALID and "another step" in (steps[1].error or "")
    write_bytes(manifest_path(job, 2), good)
    assert ckfmt.latest_step(storage) == 2
    assert len(parsed) == first + 2
    # The listing without manifests says what the full one says of each step's line.
    full = ckfmt.list_steps(storage)
    assert [s.line for s in full] == [s.line for s in ckfmt.list_steps(storage, manifests=False)]
    assert full[1].line == ckfmt.LineStep(2, 1, full[1].manifest.created_unix, ())


def test_a_commit_tells_the_live_line_its_step_without_a_parse(job, monkeypatch):
    """The manifest a commit writes is not parsed back by this process (the next save's
    look for the head, retention): its line is remembered by its bytes' digest. Another
    process parses the same bytes to the same line."""
    for step in (1, 2):
        ckpt.save(make_state(), job, step=step)
    storage = open_storage(job)
    parsed = []
    parse = ckfmt.parse_manifest
    monkeypatch.setattr(ckfmt, "parse_manifest", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    lines = [ckfmt.read_lineage(storage, step) for step in (1, 2)]
    assert ckfmt.latest_step(storage) == 2 and not parsed
    as_fresh_process(monkeypatch)
    assert [ckfmt.read_lineage(storage, step) for step in (1, 2)] == lines
    assert len(parsed) == 2 and lines[1] == ckfmt.LineStep(2, 1, lines[1].saved_unix, ())


DIGEST_LISTS = {
    "hex": [hashing.digest(b"a"), hashing.digest(b"b")],
    "empty": [],
    "digits-only": ["0" * 64],
    "uppercase": [hashing.digest(b"a"), "A" * 64],
    "leading-space": [" " + "a" * 63],
    "two-newlines": ["a" * 62 + "\n\n"],
    "short-then-long": ["a" * 63, "a" * 65],
    "not-hex": ["g" * 64],
    "fullwidth": ["\uff41" * 64],
    "bytes": [b"a" * 64],
    "int": [hashing.digest(b"a"), 7],
    "none": [None],
    "list-of-64": [["a"] * 64],
    "dict-of-64": [{f"{i:02x}": 0 for i in range(64)}],
}


@pytest.mark.parametrize("digests", list(DIGEST_LISTS.values()), ids=list(DIGEST_LISTS))
def test_all_hex_digests_says_what_is_hex_digest_says_of_each(digests):
    assert hashing.all_hex_digests(digests) == all(hashing.is_hex_digest(d) for d in digests)


def test_chunk_digest_is_the_blake3_of_the_block_digests_bytes():
    blocks = [hashing.digest(bytes([i]) * 100) for i in range(5)]
    want = hashing.blake3.blake3(b"".join(bytes.fromhex(d) for d in blocks)).hexdigest()
    assert hashing.chunk_digest(blocks) == want


def test_digest_memo_is_bounded_least_recently_used_first():
    memo: hashing.DigestMemo[int] = hashing.DigestMemo(2)
    a, b, c = (hashing.digest(x) for x in (b"a", b"b", b"c"))
    memo.put(a, 1)
    memo.put(b, 2)
    assert memo.get(a) == 1  # a is now the most recently used
    memo.put(c, 3)
    assert (memo.get(a), memo.get(b), memo.get(c), len(memo)) == (1, None, 3, 2)


# ----------------------------------------------------------------------------- not followed


def test_symlinked_shard_is_refused(job, saved, tmp_path, ckptctl):
    outside = tmp_path / "outside.bin"
    shutil.copyfile(shard_path(job, 1), outside)
    os.unlink(shard_path(job, 1))
    os.symlink(outside, shard_path(job, 1))
    with bad_input("symlink-shard"):
        with pytest.raises(ckpt.UnsafePath, match="symlink"):
            ckpt.load({}, job, step=1)
        rc, out, err = ckptctl("verify", job, "--step", "1")
        assert rc == 1
        assert "rank-00000.bin" in out + err


def test_symlinked_index_is_refused(job, saved, tmp_path):
    outside = tmp_path / "outside.json"
    shutil.copyfile(index_path(job, 1), outside)
    os.unlink(index_path(job, 1))
    os.symlink(outside, index_path(job, 1))
    with bad_input("symlink-shard"):
        with pytest.raises(ckpt.UnsafePath):
            ckpt.load({}, job, step=1)


def test_symlinked_shards_directory_is_refused(job, saved, tmp_path):
    outside = tmp_path / "outside-shards"
    shards = os.path.dirname(shard_path(job, 1))
    shutil.copytree(shards, outside)
    shutil.rmtree(shards)
    os.symlink(outside, shards)
    with bad_input("symlink-shard"):
        with pytest.raises(ckpt.UnsafePath):
            ckpt.load({}, job, step=1)


def test_symlinked_step_directory_is_refused(job, saved, tmp_path):
    outside = tmp_path / "outside-step"
    shutil.copytree(step_path(job, 1), outside)
    shutil.rmtree(step_path(job, 1))
    os.symlink(outside, step_path(job, 1))
    with bad_input("symlink-shard"):
        with pytest.raises((ckpt.UnsafePath, ckpt.CheckpointNotFound)):
            ckpt.load({}, job)
        with pytest.raises(ckpt.UnsafePath):
            ckpt.load({}, job, step=1)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("which", ["shard", "index"])
def test_fifo_posing_as_a_file_is_refused_without_hanging(job, saved, ckptctl, which):
    path = shard_path(job, 1) if which == "shard" else index_path(job, 1)
    os.unlink(path)
    os.mkfifo(path)
    with bad_input("fifo-shard"):
        with pytest.raises(ckpt.CorruptCheckpoint):
            ckpt.load({}, job, step=1)
        rc, out, err = ckptctl("verify", job, "--step", "1")
        assert rc == 1
        assert os.path.basename(path) in out + err


@pytest.mark.timeout(20)
def test_fifo_posing_as_manifest_does_not_hang(job, saved, ckptctl):
    os.unlink(manifest_path(job, 1))
    os.mkfifo(manifest_path(job, 1))
    with bad_input("fifo-shard"):
        with pytest.raises(ckpt.CkptError):
            ckpt.load({}, job, step=1)
        with pytest.raises(ckpt.CheckpointNotFound):
            ckpt.load({}, job)
        assert ckptctl("verify", job, "--all")[0] == 1


# ----------------------------------------------------------------------------- fuzz


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    job = str(tmp_path_factory.mktemp("fuzz") / "job")
    ckpt.save(make_state(), job, step=1)
    mbytes = read_raw(manifest_path(job, 1))
    ibytes = read_raw(index_path(job, 1))
    return {"job": job, "manifest": mbytes, "index": ibytes, "m": parse_manifest(mbytes)}


def _only_ckpt_errors(fn: Callable[[], Any], kind: str = "manifest-fuzz") -> None:
    with bad_input(kind):
        try:
            fn()
        except CkptError:
            pass  # InvalidManifest, UnsafePath, ...: a refusal, as it should be


def mutate_bytes(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    b = bytearray(data)
    for op, pos, val in edits:
        if not b:
            b.append(val)
            continue
        pos %= len(b)
        if op == 0:
            b[pos] = val
        elif op == 1:
            del b[pos]
        elif op == 2:
            b.insert(pos, val)
        else:
            del b[pos:]
    return bytes(b)


byte_edits = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=8
)

# Integers stay below float's range: see test_created_unix_huge_int for what lies beyond.
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.sampled_from(["../x", "/abs", "shards/rank-00000.bin", "float32", "tensor", "w", "nan"]),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)
    ),
    max_leaves=10,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def replace_at(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


@settings(suppress_health_check=list(HealthCheck))
@given(edits=byte_edits)
def test_fuzz_manifest_bytes(real, edits):
    data = mutate_bytes(real["manifest"], edits)
    _only_ckpt_errors(lambda: parse_manifest(data))


@settings(suppress_health_check=list(HealthCheck))
@given(doc=json_values)
def test_fuzz_random_json(real, doc):
    data = json.dumps(doc).encode()
    _only_ckpt_errors(lambda: parse_manifest(data))
    m = real["m"]
    _only_ckpt_errors(
        lambda: parse_index(data, manifest=m, shard=m.shards[0], max_entries=10, what="x"),
        "index-fuzz",
    )


@settings(suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=json_values)
def test_fuzz_manifest_fields(real, data, value):
    doc = json.loads(real["manifest"])
    path = data.draw(st.sampled_from(_paths(doc)))
    raw = json.dumps(replace_at(doc, path, value)).encode()
    _only_ckpt_errors(lambda: parse_manifest(raw))


@settings(suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=json_values)
def test_fuzz_index_fields(real, data, value):
    doc = json.loads(real["index"])
    path = data.draw(st.sampled_from(_paths(doc)))
    raw = json.dumps(replace_at(doc, path, value)).encode()
    m = real["m"]
    _only_ckpt_errors(
        lambda: parse_index(raw, manifest=m, shard=m.shards[0], max_entries=10, what="x"),
        "index-fuzz",
    )


@settings(suppress_health_check=list(HealthCheck), max_examples=30)
@given(
    data=st.data(),
    value=json_values,
    edits=byte_edits,
    which=st.sampled_from(["manifest", "index", "index-bytes"]),
)
def test_fuzz_load_end_to_end(real, tmp_path, data, value, edits, which):
    """Through ckpt.load with real files: only CkptError, or a successful load."""
    job = os.path.join(tempfile.mkdtemp(dir=tmp_path), "job")
    shutil.copytree(real["job"], job)
    try:
        if which == "manifest":
            doc = json.loads(real["manifest"])
            path = data.draw(st.sampled_from(_paths(doc)))
            write_bytes(manifest_path(job, 1), json.dumps(replace_at(doc, path, value)).encode())
        elif which == "index":
            doc = json.loads(real["index"])
            path = data.draw(st.sampled_from(_paths(doc)))
            write_index_consistently(job, 1, json.dumps(replace_at(doc, path, value)).encode())
        else:
            write_index_consistently(job, 1, mutate_bytes(real["index"], edits))
        _only_ckpt_errors(lambda: ckpt.load({}, job, step=1), f"{which.split('-')[0]}-fuzz")
    finally:
        shutil.rmtree(job)


def test_intact_copy_loads(real, tmp_path):
    """The fuzz tests' base checkpoint is itself valid (so rejections are the mutations')."""
    job = str(tmp_path / "copy")
    shutil.copytree(real["job"], job)
    assert_same(ckpt.load({}, job).state, make_state())
    assert hashing.digest(real["index"]) == real["m"].shards[0].index_blake3
