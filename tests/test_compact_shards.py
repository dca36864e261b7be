"""Packed shards (format version 2): a save's files hold each chunk once, whatever the ranks.

Real ranks (gloo, tests/ranks/compact_worker.py) save a replicated state (DDP) and a
half-sharded half-replicated one: the shard files' sizes (st_size, the logical length a
copy or an upload moves) and the bytes the ranks' storage counters saw written add up to
the state, not to world x the state; every index tiles its shard; the load is bit-exact;
`ckptctl verify` is clean. Over a small staging budget (entries written from the caller's
tensors before save() returns) the same holds. The v2 reader refuses an index with a gap,
and a version-1 checkpoint in the old layout (holes where replicas had their place) still
loads and verifies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from coordinator_fixtures import ckptctl, spawn_ranks
from ranks import compact_worker

import ckpt
from ckptd import knobs
from ckptd.errors import InvalidManifest
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, manifest
from ckptd.storage import open_storage

FIXTURES = Path(__file__).parent / "fixtures"

ALIGN = 4096
SLACK = 1.02


def run_ranks(world: int, job: Path, out: Path, spec: dict, timeout: float = 120) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = spawn_ranks(
        compact_worker.spawn_entry,
        world,
        lambda r, port: (r, world, port, str(job), str(out), spec),
        out,
        timeout=timeout,
    )
    assert [p.exitcode for p in procs] == [0] * world, logs
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for res in results:
        assert not res.get("error"), res["error"]
        assert res["exact"], f"rank {res['rank']}: the load is not bit-exact"
    return results


def shard_files(job: Path, step: int) -> list[Path]:
    return sorted((job / f"step-{step:012d}" / "shards").glob("rank-*.bin"))


def check_compact(job: Path, results: list[dict], world: int) -> None:
    state = results[0]["state_bytes"]
    limit = SLACK * state + world * ALIGN
    files = shard_files(job, 1)
    assert len(files) == world
    on_disk = sum(f.stat().st_size for f in files)
    written = sum(r["written"] for r in results)
    assert on_disk <= limit, (
        f"{world} ranks: shard files hold {on_disk} bytes for a {state}-byte state "
        f"({on_disk / state:.2f}x): replicas assigned elsewhere left their places"
    )
    assert written <= limit, (
        f"{world} ranks wrote {written} bytes for {state} ({written / state:.2f}x)"
    )
    assert on_disk >= state and written >= state  # every chunk is somewhere
    opened = ckfmt.open_checkpoint(open_storage(str(job)), 1)
    assert {i.shard for i in opened.indexes} == {f"shards/{f.name}" for f in files}
    for index in opened.indexes:
        assert (
            manifest.packing_gap(index.entries, index.shard_size, index.alignment, index.version)
            is None
        )
    rc, out, err = ckptctl("verify", str(job), "--all")
    assert rc == 0, out + err


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["replicated", "half"])
def test_four_ranks_write_the_state_once(tmp_path, kind):
    job = tmp_path / "job"
    results = run_ranks(4, job, tmp_path / "out", {"kind": kind, "mib": 8})
    check_compact(job, results, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("budget", [0, 3 << 20])
def test_over_the_staging_budget_only_assigned_entries_are_written(tmp_path, budget):
    # 0: every entry from the tensors; 3 MiB: some staged, the rest (of 8 MiB) from them.
    job = tmp_path / "job"
    spec = {"kind": "replicated", "mib": 8, "staging_budget_bytes": budget}
    results = run_ranks(2, job, tmp_path / "out", spec)
    check_compact(job, results, 2)


def test_the_writer_writes_straight_from_the_image_unless_it_must_gather():
    from ckptd.format import writer

    sizes = [3 << 20, 5000, 1 << 20, 12345]
    image_offsets, size = writer.plan_offsets(sizes, ALIGN)
    image = np.arange(size, dtype=np.uint64).astype(np.uint8)
    items = [
        writer.WriteItem(f"t{i}", "uint8", [n], [0], [n], image[o : o + n])
        for i, (o, n) in enumerate(zip(image_offsets, sizes, strict=True))
    ]
    window = 1 << 20
    # Nothing deduplicated: the file is the image; each window is one piece of it, in place.
    wins = writer._gather_windows(image, image_offsets, image_offsets, items, ALIGN, window)
    assert sum(n for _, n, _ in wins) == size
    for off, n, pieces in wins:
        assert len(pieces) == 1 and pieces[0][0] == off and pieces[0][1].nbytes == n
        assert np.shares_memory(pieces[0][1], image[off : off + n])
    # Entry 1 written by another rank: 0 and 2 packed together, pieces from the image.
    keep = [0, 2, 3]
    offsets, packed = writer.plan_offsets([sizes[i] for i in keep], ALIGN)
    wins = writer._gather_windows(
        image, [image_offsets[i] for i in keep], offsets, [items[i] for i in keep], ALIGN, window
    )
    out = np.zeros(packed, np.uint8)
    for off, n, pieces in wins:
        for p_off, arr in pieces:
            assert off <= p_off and p_off + arr.nbytes <= off + n
            out[p_off : p_off + arr.nbytes] = arr
    for i, o in zip(keep, offsets, strict=True):
        assert np.array_equal(out[o : o + sizes[i]], items[i].data)
    assert packed == size - writer.plan_offsets([sizes[1]], ALIGN)[1]


def test_a_v2_index_with_a_gap_is_refused(tmp_path, tally):
    job = str(tmp_path / "job")
    ckpt.save({"a": torch.arange(4096.0), "b": torch.ones(100)}, job, step=1)
    sdir = Path(job) / "step-000000000001"
    index_path = next((sdir / "shards").glob("rank-*.json"))
    doc = json.loads(index_path.read_text())
    assert doc["version"] == 2
    last = max(doc["entries"], key=lambda e: e["offset"])
    last["offset"] += ALIGN  # a hole before the last entry, the file grown to match
    shard = sdir / "shards" / Path(last["file"]).name
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size + ALIGN)
    size = shard.stat().st_size
    doc["shard_size"] = size
    data = json.dumps(doc).encode()
    index_path.write_bytes(data)
    m = json.loads((sdir / "MANIFEST.json").read_text())
    for s in m["shards"]:
        s.update(size=size, index_size=len(data), index_blake3=hashing.digest(data))
    (sdir / "MANIFEST.json").write_bytes(json.dumps(m).encode())
    with tally.bad_input("v2 shard index with a gap between entries"):
        with pytest.raises(
            InvalidManifest, match=r"not packed.*rank-00000\.bin|rank-00000.*not packed"
        ):
            ckfmt.open_checkpoint(open_storage(job), 1)


# -- version 1: checkpoints written by the old layout --------------------------------------
def _v1_with_holes(job: Path) -> None:
    """Rewrite step 1 of `job` into what today's main wrote at 2 ranks: format version 1,
    each rank's file laid out like its staging image (every entry it holds has its place,
    the ones another rank wrote are holes), its index naming only the entries it wrote."""
    sdir = job / "step-000000000001"
    m = json.loads((sdir / "MANIFEST.json").read_text())
    indexes = {s["rank"]: json.loads((sdir / s["index"]).read_text()) for s in m["shards"]}
    # Both ranks held every entry: the image order is the keys' order over both indexes.
    held = sorted(
        ((e["key"], e["length"]) for d in indexes.values() for e in d["entries"]),
        key=lambda kv: kv[0],
    )
    image_off, pos = {}, 0
    for key, n in held:
        image_off[key] = pos
        pos = -(-(pos + n) // ALIGN) * ALIGN
    for s in m["shards"]:
        doc = indexes[s["rank"]]
        old = (sdir / s["path"]).read_bytes()
        img = bytearray(pos)
        for e in doc["entries"]:
            o = image_off[e["key"]]
            img[o : o + e["length"]] = old[e["offset"] : e["offset"] + e["length"]]
            e["offset"] = o
        path = sdir / s["path"]
        with open(path, "wb") as f:  # holes where the other rank's entries are
            for e in doc["entries"]:
                f.seek(e["offset"])
                f.write(img[e["offset"] : e["offset"] + e["length"]])
            f.truncate(pos)
        doc.update(version=1, shard_size=pos)
        data = json.dumps(doc, separators=(",", ":")).encode()
        (sdir / s["index"]).write_bytes(data)
        s.update(size=pos, index_size=len(data), index_blake3=hashing.digest(data))
    m["version"] = 1
    (sdir / "MANIFEST.json").write_bytes(json.dumps(m, separators=(",", ":")).encode())


@pytest.mark.multiprocess
def test_a_v1_checkpoint_with_holes_loads_and_verifies(tmp_path):
    job = tmp_path / "job"
    run_ranks(2, job, tmp_path / "out", {"kind": "replicated", "mib": 1})
    v1 = tmp_path / "v1"
    shutil.copytree(job / "step-000000000001", v1 / "step-000000000001")
    _v1_with_holes(v1)
    files = shard_files(v1, 1)
    state, _ = compact_worker.make_state(1, "replicated", 1, fresh=False)
    total = sum(t.numel() * 4 for t in state.values())
    assert all(f.stat().st_size == total for f in files)  # the old layout: N x the state
    assert json.loads((v1 / "step-000000000001" / "MANIFEST.json").read_text())["version"] == 1
    rc, out, err = ckptctl("verify", str(v1), "--all")
    assert rc == 0, out + err
    fresh, _ = compact_worker.make_state(1, "replicated", 1, fresh=True)
    ckpt.load(fresh, str(v1), step=1)
    for k, t in state.items():
        assert np.array_equal(fresh[k].numpy(), t.numpy()), k
    assert knobs.get().alignment == ALIGN


def test_a_v1_checkpoint_written_by_the_old_code_loads_and_verifies(tmp_path):
    # tests/fixtures/v1-holes-2ranks: written by ckptd before packed shards (its README).
    job = tmp_path / "job"
    shutil.copytree(FIXTURES / "v1-holes-2ranks" / "step-000000000001", job / "step-000000000001")
    opened = ckfmt.open_checkpoint(open_storage(str(job)), 1)
    assert json.loads((job / "step-000000000001" / "MANIFEST.json").read_text())["version"] == 1
    gaps = [manifest.packing_gap(i.entries, i.shard_size, i.alignment) for i in opened.indexes]
    assert len(gaps) == 2 and all(gaps), gaps  # the old layout: holes where replicas were
    rc, out, err = ckptctl("verify", str(job), "--all", "--level", "full")
    assert rc == 0 and "step 1: OK" in out, out + err
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    fresh = {f"w{i}": torch.zeros(64, 64) for i in range(4)}
    ckpt.load(fresh, str(job), step=1)
    for i in range(4):
        assert torch.equal(fresh[f"w{i}"], base * (i + 1) / 7), i
