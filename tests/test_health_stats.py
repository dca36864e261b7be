"""A checkpoint that knows it is healthy: per-tensor NaN/Inf counts, L2 norm and max |x|
recorded in the shard index as the bytes are hashed, shown by ckptctl, and used by
require_finite in the load policy (docs/concepts.md, Health).

Real saves with NaN and Inf injected into some tensors; the recorded stats are checked
against torch computing them directly; a 2-rank gloo job shows every rank skipping a step
that only one rank's chunk makes sick.
"""

from __future__ import annotations

import gc
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import edit_index, entry, writes_direct
from coordinator_fixtures import spawn_ranks
from ranks import health_worker

import ckpt
from ckptd import knobs
from ckptd.errors import CheckpointExists, InvalidManifest, NonFiniteCheckpoint
from ckptd.format import checkpoint as ckfmt
from ckptd.format import health, tensorstats, writer
from ckptd.format.writer import WriteItem, write_shard
from ckptd.storage import counters, open_storage
from ckptd.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(180)

FLOATS = [
    "float64",
    "float32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
# The formats that can hold an Inf (the others saturate or have only NaN).
HAS_INF = {"float64", "float32", "bfloat16", "float16", "float8_e5m2"}


def expected(t: torch.Tensor) -> tuple[int, int, float, float]:
    """(NaN, Inf, sum of squares of the finite values, max |finite|), by torch directly."""
    f = t.detach().double().reshape(-1)
    fin = f[torch.isfinite(f)]
    return (
        int(torch.isnan(f).sum()),
        int(torch.isinf(f).sum()),
        float((fin * fin).sum()),
        float(fin.abs().max()) if fin.numel() else 0.0,
    )


def sick(dtype: str, n: int, seed: int) -> torch.Tensor:
    """n values of `dtype`, a few of them NaN (and Inf where the format has one)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 4).to(getattr(torch, dtype))
    if dtype != "float8_e8m0fnu":  # no NaN below its all-ones byte; set it as bits
        for i in (3, n // 2, n - 1):
            t[i] = float("nan")
    else:
        t.view(torch.uint8)[[3, n - 1]] = 0xFF
    if dtype in HAS_INF:
        t[5] = float("inf")
        t[n - 2] = -float("inf")
    return t


def stats_of(job: str, step: int, key: str) -> dict[str, Any]:
    return entry(job, step, key)["stats"]


def assert_matches(got: dict[str, Any], t: torch.Tensor) -> None:
    nan, inf, sumsq, max_abs = expected(t)
    assert (got["nan"], got["inf"]) == (nan, inf)
    assert got["sumsq"] == pytest.approx(sumsq, rel=1e-5)
    assert got["max_abs"] == max_abs  # exact: one of the values


@pytest.mark.parametrize("dtype", FLOATS)
def test_stats_match_torch_for_every_float_dtype(tmp_path: Path, dtype: str) -> None:
    """Several hash blocks (the blocks' stats added up) and one short, odd-length tensor."""
    job = str(tmp_path / "job")
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    big = sick(dtype, (3 << 20) // itemsize + 7, seed=1)  # 3 MiB and a bit: 4 blocks
    small = sick(dtype, 13, seed=2)
    ckpt.save({"big": big, "small": small, "ids": torch.arange(9)}, job, step=1)
    assert_matches(stats_of(job, 1, "big"), big)
    assert_matches(stats_of(job, 1, "small"), small)
    assert "stats" not in entry(job, 1, "ids")  # integers have none


def test_float4_pairs_and_edge_values(tmp_path: Path) -> None:
    job = str(tmp_path / "job")
    fp4 = torch.arange(256, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2
    want = sum(e2m1[b & 0xF] ** 2 + e2m1[b >> 4] ** 2 for b in range(256))
    empty = torch.empty(0, 3)
    huge = torch.tensor([3e38, 3e38, -1.0])  # squares beyond float32: summed in float64
    bf = torch.tensor([1e30, -2e30, float("nan")], dtype=torch.bfloat16)
    ckpt.save({"fp4": fp4, "empty": empty, "huge": huge, "bf": bf}, job, step=1)
    assert stats_of(job, 1, "fp4") == {"nan": 0, "inf": 0, "sumsq": want, "max_abs": 6.0}
    assert stats_of(job, 1, "empty") == {"nan": 0, "inf": 0, "sumsq": 0.0, "max_abs": 0.0}
    assert_matches(stats_of(job, 1, "huge"), huge)
    assert_matches(stats_of(job, 1, "bf"), bf)


def test_the_writer_path_without_precomputed_hashes_records_stats(tmp_path: Path) -> None:
    """write_shard hashes while it writes (DCP and Lightning commit this way)."""
    t = sick("float32", 50_000, seed=3)
    data = t.view(torch.uint8).numpy()
    item = WriteItem("x", "float32", [50_000], [0], [50_000], data)
    storage = open_storage(str(tmp_path / "job"))
    ckfmt.begin_step(storage, 7)
    write_shard(storage, job="job", step=7, rank=0, world_size=1, generation=0, items=[item])
    assert item.stats is not None
    index = json.loads((tmp_path / "job" / "step-000000000007/shards/rank-00000.json").read_text())
    assert_matches(index["entries"][0]["stats"], t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_hashed_in_place_and_from_a_copy_record_the_same_stats(
    tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer takes a block's stats before its hash when it reads the block from memory
    (a Checkpointer's staging image) and after it when the block was just copied (a
    one-shot save's bounce copy): both orders record the same, right stats, and each
    save here takes the path it is meant to."""
    paths: list[bool] = []
    block_of = writer._Hasher.block_of

    def spy(self: Any, i: int, b: int, data: np.ndarray, copied: bool = False) -> None:
        paths.append(copied)
        block_of(self, i, b, data, copied)

    monkeypatch.setattr(writer._Hasher, "block_of", spy)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    big = sick(dtype, (3 << 20) // itemsize + 7, seed=4)  # 4 blocks
    one_shot, staged = str(tmp_path / "one-shot"), str(tmp_path / "staged")
    with knobs.override(io_window=1 << 20):  # several windows: the staged writes' copy
        ckpt.save({"big": big}, one_shot, step=1)
    assert_matches(stats_of(one_shot, 1, "big"), big)
    if writes_direct(LocalStorage(one_shot)):  # the bounce copy is for O_DIRECT writes only
        assert any(paths), "the one-shot save hashed no block from its bounce copy"
    paths.clear()
    with ckpt.Checkpointer(staged) as cp:
        cp.save({"big": big}, 1).wait()
    assert paths and not any(paths), "the staged save hashed a block from a copy"
    assert_matches(stats_of(staged, 1, "big"), big)


def test_a_saves_block_stats_stay_out_of_the_collectors_sight() -> None:
    """A save holds one block's stats per MiB until it settles; as plain tuples of numbers
    the collector stops tracking them, so young collections during the save do not move
    thousands of them into the oldest generation (docs/configuration.md)."""
    data = torch.randn(3 << 18).view(torch.uint8).numpy()  # 3 MiB of float32: 3 blocks
    item = WriteItem("x", "float32", [3 << 18], [0], [3 << 18], data)
    ints = torch.arange(1 << 18).view(torch.uint8).numpy()  # int64: no stats
    other = WriteItem("i", "int64", [1 << 18], [0], [1 << 18], ints)
    small = torch.randn(5)
    last = WriteItem("y", "float32", [5], [0], [5], small.view(torch.uint8).numpy())
    hasher = writer._Hasher([item, other, last], 1 << 20)
    hasher.run_all(8 << 20)
    # Every item's blocks in one list, each item's from its first (-1: none of its own).
    assert hasher.first == [0, -1, 3] and len(hasher.parts) == 4
    gc.collect()
    assert not any(gc.is_tracked(p) for p in hasher.parts)
    assert item.stats == tensorstats.combine(hasher.parts[:3])
    assert item.stats.sumsq == pytest.approx(
        float((data.view(np.float32).astype(np.float64) ** 2).sum()), rel=1e-5
    )
    assert other.stats is None
    assert last.stats is not None
    assert last.stats.sumsq == pytest.approx(float((small.double() ** 2).sum()), rel=1e-5)


def test_block_stats_agree_with_torch_on_random_bits() -> None:
    """Every byte pattern of the 16- and 8-bit formats (NaN payloads, subnormals, -0)."""
    rng = np.random.default_rng(0)
    for dtype, extra in [(d, n) for d in ("bfloat16", "float16") for n in (999, 1000)]:
        # bfloat16 goes two at a time when the block holds an even count (_bf16_pairs)
        bits = np.concatenate([np.arange(65536), rng.integers(0, 65536, extra)]).astype(np.uint16)
        t = torch.from_numpy(bits.view(np.int16)).view(getattr(torch, dtype))
        s = tensorstats.block_stats(bits.view(np.uint8), dtype)
        nan, inf, sumsq, max_abs = expected(t)
        assert (s.nan, s.inf, s.max_abs) == (nan, inf, max_abs), dtype
        assert s.sumsq == pytest.approx(sumsq, rel=1e-5), dtype
        finite = bits[np.isfinite(t.float().numpy())]  # the pairs path's own case: no NaN/Inf
        finite = finite[: len(finite) // 2 * 2]
        t = torch.from_numpy(finite.view(np.int16)).view(getattr(torch, dtype))
        s = tensorstats.block_stats(finite.view(np.uint8), dtype)
        nan, inf, sumsq, max_abs = expected(t)
        assert (s.nan, s.inf, s.max_abs) == (0, 0, max_abs), dtype
        assert s.sumsq == pytest.approx(sumsq, rel=1e-5), dtype
    for dtype in FLOATS[4:]:
        bits = np.arange(256, dtype=np.uint8)
        t = torch.from_numpy(bits.copy()).view(getattr(torch, dtype))
        s = tensorstats.block_stats(bits, dtype)
        assert (s.nan, s.inf, s.sumsq, s.max_abs) == expected(t), dtype


def test_stats_and_require_finite_cost_no_storage_reads(tmp_path: Path) -> None:
    """The stats ride the hash pass: a save reads and writes the same shard bytes with
    them as without (verify="full" re-reads its shard once either way); judging a step
    reads its indexes only, so a load that refuses the newest step reads what a load of
    the older one alone reads."""
    w = torch.randn(1 << 19)
    with knobs.override(health_stats=False):
        before = counters.snapshot()
        ckpt.save({"w": w}, str(tmp_path / "off"), step=1)
        off = counters.snapshot() - before
    before = counters.snapshot()
    ckpt.save({"w": w}, str(tmp_path / "on"), step=1)
    on = counters.snapshot() - before
    assert (on.read_bytes, on.written_bytes) == (off.read_bytes, off.written_bytes)
    assert on.read_bytes >= w.nbytes  # the re-read happened: the comparison means something
    job = str(tmp_path / "on")
    ckpt.save({"w": torch.full_like(w, float("nan"))}, job, step=2)
    before = counters.snapshot()
    assert ckpt.load({}, job, step=1).step == 1
    alone = counters.snapshot() - before
    before = counters.snapshot()
    assert ckpt.load({}, job, require_finite=True).step == 1
    judged = counters.snapshot() - before
    assert judged.read_bytes == alone.read_bytes > 0


def test_resume_require_finite_lands_on_the_newest_healthy_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:
        for step in (1, 2, 3, 4):
            w = torch.full((64,), float(step))
            if step == 3:
                w[10] = float("inf")
            if step == 4:
                w[[1, 2]] = float("nan")
            cp.save({"w": w, "b": torch.ones(3)}, step, blocking=True)
    state = {"w": torch.zeros(64), "b": torch.zeros(3)}
    caplog.set_level(logging.INFO, logger="ckpt")
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume(state, require_finite=True) == 2
        assert cp.last_load is not None and cp.last_load.unhealthy == [4, 3]
        assert cp.last_load.quarantined == []
    assert torch.equal(state["w"], torch.full((64,), 2.0))
    text = caplog.text
    assert "step 4" in text and "key 'w': 2 NaN, 0 Inf" in text
    assert "step 3" in text and "key 'w': 0 NaN, 1 Inf" in text
    assert job in text and "SKIPPED (require_finite)" in text
    assert "resumed from step 2, the newest step with finite values" in text
    # Whole steps, not damage: nothing is quarantined, and a plain resume takes step 4.
    assert [s.status for s in ckfmt.list_steps(open_storage(job))] == [ckfmt.COMMITTED] * 4
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume({"w": torch.zeros(64), "b": torch.zeros(3)}) == 4


def test_a_step_require_finite_passed_over_gives_way_to_the_next_save_of_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Training resumed past a step with NaN values reaches that step again: its save takes
    the NaN step's place (it was refused, and the job stopped there after every restart).
    Only the Checkpointer whose load passed the step over does so; a save of a whole step
    from anywhere else is still refused."""
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:
        for step in (10, 20, 30):
            w = torch.full((64,), float(step))
            if step == 30:
                w[5] = float("nan")
            cp.save({"w": w}, step, blocking=True)
    state = {"w": torch.zeros(64)}
    with caplog.at_level(logging.WARNING), ckpt.Checkpointer(job) as cp:
        assert cp.resume(state, require_finite=True) == 20
        for step in range(21, 41):
            state["w"].fill_(float(step))
            cp.maybe_save(state, step, every=10)  # 30 again, then 40
    assert any(
        "takes the place of the quarantined checkpoint" in r.getMessage()
        and "NaN or Inf" in r.getMessage()
        for r in caplog.records
    )
    infos = {i.step: i.status for i in ckfmt.list_steps(open_storage(job))}
    assert infos == {10: "COMMITTED", 20: "COMMITTED", 30: "COMMITTED", 40: "COMMITTED"}
    assert torch.equal(ckpt.load({}, job, step=30).state["w"], torch.full((64,), 30.0))
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume({"w": torch.zeros(64)}, require_finite=True) == 40
        with pytest.raises(CheckpointExists, match="already committed"):
            cp.save({"w": torch.zeros(64)}, 30, blocking=True)


def test_require_finite_by_explicit_step_keys_and_exhaustion(tmp_path: Path) -> None:
    job = str(tmp_path / "job")
    nan = torch.tensor([1.0, float("nan")])
    ckpt.save({"model": {"w": nan}, "optim": {"m": torch.ones(2)}}, job, step=1)
    ckpt.save({"model": {"w": torch.ones(2)}, "optim": {"m": nan}}, job, step=2)
    with pytest.raises(NonFiniteCheckpoint, match=r"step 2: 1 tensor\(s\).*'optim/m': 1 NaN"):
        ckpt.load({}, job, step=2, require_finite=True)
    assert ckpt.load({}, job, step=2).step == 2  # without it, the step loads
    # Only the selected keys count: the model of step 2 is finite.
    assert ckpt.load({}, job, keys="model", require_finite=True).step == 2
    assert ckpt.load({}, job, keys="optim", require_finite=True).step == 1
    with pytest.raises(NonFiniteCheckpoint, match="no committed step could be loaded"):
        ckpt.load({}, job, require_finite=True)
    with pytest.raises(ckpt.CheckpointNotFound, match="none can be loaded whole"):
        with ckpt.Checkpointer(job) as cp:
            cp.resume({}, require_finite=True)
    with ckpt.Checkpointer(job) as cp:
        assert cp.resume({}, require_finite=True, allow_fresh_start=True) is None


def test_steps_saved_without_stats_are_unknown_and_load_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As a step written before ckptd recorded stats: no `stats` field in its index."""
    job = str(tmp_path / "job")
    with knobs.override(health_stats=False):
        ckpt.save({"w": torch.ones(8)}, job, step=1)
        ckpt.save({"w": torch.tensor([float("nan")] * 8)}, job, step=2)  # unknowable
    ckpt.save({"w": torch.tensor([float("nan")] * 8)}, job, step=3)
    assert "stats" not in entry(job, 1, "w") and "stats" in entry(job, 3, "w")
    caplog.set_level(logging.WARNING, logger="ckpt")
    res = ckpt.load({}, job, require_finite=True)
    assert (res.step, res.unhealthy) == (2, [3])
    assert "have no health stats" in caplog.text and "step 2" in caplog.text
    ck = ckfmt.open_checkpoint(open_storage(job), 2)
    h = health.check(ck)
    assert h.finite and [k.key for k in h.unknown] == ["w"]


@pytest.mark.parametrize(
    "bad, why",
    [
        ("not a dict", "an object of exactly nan, inf, sumsq, max_abs"),
        ({"nan": 0, "inf": 0, "sumsq": 1.0}, "an object of exactly"),
        ({"nan": 0, "inf": 0, "sumsq": 1.0, "max_abs": 1.0, "x": 1}, "an object of exactly"),
        ({"nan": -1, "inf": 0, "sumsq": 1.0, "max_abs": 1.0}, "stats.nan must be an integer"),
        ({"nan": True, "inf": 0, "sumsq": 1.0, "max_abs": 1.0}, "stats.nan must be an integer"),
        ({"nan": 0, "inf": 1.5, "sumsq": 1.0, "max_abs": 1.0}, "stats.inf must be an integer"),
        ({"nan": 5, "inf": 4, "sumsq": 1.0, "max_abs": 1.0}, "in a chunk of 8 elements"),
        ({"nan": 0, "inf": 0, "sumsq": -1.0, "max_abs": 1.0}, "stats.sumsq must be a finite"),
        ({"nan": 0, "inf": 0, "sumsq": 1.0, "max_abs": "1"}, "stats.max_abs must be a finite"),
    ],
)
def test_a_malformed_stats_field_names_the_file_and_key(
    tmp_path: Path, tally: Any, bad: Any, why: str
) -> None:
    job = str(tmp_path / "job")
    ckpt.save({"model": {"w": torch.ones(8)}}, job, step=1)

    def spoil(doc: dict) -> None:
        doc["entries"][0]["stats"] = bad

    edit_index(job, 1, spoil)
    with tally.bad_input(f"index stats field: {why}"):
        with pytest.raises(InvalidManifest) as ei:
            ckpt.load({}, job, step=1)
        msg = str(ei.value)
        assert why in msg and "key 'model/w'" in msg
        assert "step-000000000001/shards/rank-00000.json" in msg


@pytest.mark.parametrize("field", ["sumsq", "max_abs"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_stats_are_never_written_into_an_index(field: str, value: float) -> None:
    # The index's writer would write them as null: TensorStats refuses them first.
    stats = tensorstats.TensorStats(0, 0, **{field: value})
    with pytest.raises(ValueError, match="not finite"):
        stats.to_json()
    assert tensorstats.TensorStats(1, 2, 3.0, 4.0).to_json() == {
        "nan": 1,
        "inf": 2,
        "sumsq": 3.0,
        "max_abs": 4.0,
    }


def test_stats_on_an_integer_entry_are_refused(tmp_path: Path, tally: Any) -> None:
    job = str(tmp_path / "job")
    ckpt.save({"ids": torch.arange(8)}, job, step=1)
    edit_index(
        job,
        1,
        lambda d: d["entries"][0].update(stats={"nan": 0, "inf": 0, "sumsq": 0, "max_abs": 0}),
    )
    with tally.bad_input("index stats field on an integer dtype"):
        with pytest.raises(InvalidManifest, match=r"key 'ids'.*dtype int64 has none"):
            ckfmt.open_checkpoint(open_storage(job), 1)


def test_ckptctl_inspect_stats_and_diff_norms(tmp_path: Path, ckptctl: Any) -> None:
    job = str(tmp_path / "job")
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(40, 5, generator=g), torch.randn(5, generator=g).bfloat16()
    w2 = w1 * 1.1
    b2 = b1 * 3  # the norm jumps x3
    w3 = w2.clone()
    w3[1, 1] = float("nan")
    ids = torch.arange(4)
    ckpt.save({"w": w1, "b": b1, "ids": ids}, job, step=1)
    ckpt.save({"w": w2, "b": b2, "ids": ids}, job, step=2)
    ckpt.save({"w": w3, "b": b2, "ids": ids}, job, step=3)

    rc, out, err = ckptctl("inspect", job, "--step", "3", "--stats", "--json")
    assert rc == 0, err
    by = {s["key"]: s for s in json.loads(out)["stats"]}
    assert set(by) == {"w", "b"}  # floating-point tensors only
    assert (by["w"]["nan"], by["w"]["inf"], by["w"]["known"]) == (1, 0, True)
    assert by["w"]["norm"] == pytest.approx(math.sqrt(expected(w3)[2]), rel=1e-6)
    assert by["b"]["max_abs"] == expected(b2)[3]
    rc, out, _ = ckptctl("inspect", job, "--step", "3", "--stats")
    assert rc == 0
    lines = out.splitlines()
    assert any(ln.startswith("!  w ") and " 1 " in ln for ln in lines), out
    assert any(ln.startswith("   b ") for ln in lines), out
    assert "health     2 floating-point tensor(s): 1 with NaN or Inf values" in lines
    rc, out, _ = ckptctl("inspect", job, "--step", "3")
    assert "NORM" not in out  # only with --stats

    rc, out, err = ckptctl("diff", job, "1", "2", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["stand_out"] == ["b"] and doc["norm_jump"] == 2.0
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["b"]["norm"]["flags"] == [health.JUMP]
    assert keys["b"]["norm"]["ratio"] == pytest.approx(3.0, rel=1e-2)
    assert keys["w"]["norm"]["ratio"] == pytest.approx(1.1, rel=1e-5)
    assert keys["w"]["norm"]["flags"] == []
    assert (
        json.loads(ckptctl("diff", job, "1", "2", "--norm-jump", "4", "--json")[1])["stand_out"]
        == []
    )  # x3 is under a factor of 4

    rc, out, _ = ckptctl("diff", job, "2", "3")
    lines = out.splitlines()
    assert lines[0] == "! w (index: 1 of 1 chunk(s) differ)"
    assert "!! NaN/Inf 0 -> 1" in lines[1]
    assert lines[-1].endswith("; 1 stand out (norm changed more than x2, or new NaN/Inf)")
    assert ckptctl("diff", job, "1", "2", "--norm-jump", "1")[0] == 2  # a usage error


def test_a_step_without_stats_in_ckptctl(tmp_path: Path, ckptctl: Any) -> None:
    job = str(tmp_path / "job")
    with knobs.override(health_stats=False):
        ckpt.save({"w": torch.ones(4)}, job, step=1)
    ckpt.save({"w": torch.ones(4)}, job, step=2)
    rc, out, _ = ckptctl("inspect", job, "--step", "1", "--stats")
    assert rc == 0 and "no stats" in out and "1 without stats" in out
    doc = json.loads(ckptctl("diff", job, "1", "2", "--json", "--all")[1])
    assert doc["keys"][0]["norm"] is None and doc["stand_out"] == []


def _spawn(job: str, out: Path, timeout: float = 150) -> list[dict[str, Any]]:
    out.mkdir(exist_ok=True)
    _, logs = spawn_ranks(
        health_worker.entry, 2, lambda r, port: (r, 2, port, job, str(out)), out, timeout=timeout
    )
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["error"] is None for r in results), logs
    return results


@pytest.mark.multiprocess
def test_two_ranks_skip_a_step_only_one_ranks_chunk_makes_sick(
    tmp_path: Path, ckptctl: Any
) -> None:
    """Step 4's NaN is in rank 1's rows only; rank 0 skips it too (every rank judges the
    whole step's indexes), and both land on step 2. ckptctl combines the two chunks."""
    job = str(tmp_path / "job")
    results = _spawn(job, tmp_path / "out")
    for r in results:
        assert r["resumed"] == 2 and r["values_are_step_2"], r
        assert r["unhealthy"] == [4, 3], r
        skipped = [m for m in r["messages"] if "SKIPPED (require_finite)" in m]
        assert any("step 4" in m and "key 'w': 1 NaN, 0 Inf" in m for m in skipped), r
        assert any("step 3" in m and "key 'w': 1 NaN, 1 Inf" in m for m in skipped), r
        assert r["resumed_without"] == 4  # without require_finite: the newest step
        assert r["rep_step"] == 4  # keys="rep": only the replica counts, finite in step 4
    assert any(
        "resumed from step 2, the newest step with finite values" in m
        for m in results[0]["messages"]
    )

    rc, out, err = ckptctl("inspect", job, "--step", "3", "--stats", "--json")
    assert rc == 0, err
    w = next(s for s in json.loads(out)["stats"] if s["key"] == "w")
    whole = health_worker.full(3)
    assert (w["chunks"], w["nan"], w["inf"]) == (2, 1, 1)
    assert w["norm"] == pytest.approx(math.sqrt(expected(whole)[2]), rel=1e-6)
    assert w["max_abs"] == expected(whole)[3]
    flags = {
        k["key"]: k["norm"]["flags"]
        for k in json.loads(ckptctl("diff", job, "2", "3", "--json")[1])["keys"]
        if k["norm"]
    }
    assert flags["w"] == [health.NONFINITE]
