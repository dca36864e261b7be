"""save -> load is the identity, bit for bit, for every kind of value ckptd stores.

Property tests draw nested dicts/lists/tuples of tensors of every supported dtype (0-d,
empty, non-contiguous, conjugate and offset views), numpy arrays and scalars, and plain
values (huge ints, nan/inf/-0.0, unicode, bytes), save them as a step and load them back
twice: into `{}` and into a preallocated copy of the structure with zeroed tensors.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import (
    assert_same,
    index_entries,
    step_path,
    tensor_raw,
    zeroed_like,
)
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

import ckpt
from ckptd import knobs
from ckptd.format import dtypes, layout

DTYPE_NAMES = list(dtypes.SUPPORTED)
NP_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]

# ----------------------------------------------------------------------------- tensors


def random_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of any supported dtype from random bytes (float8/uint/complex32 by view)."""
    dtype = dtypes.from_name(dtype_name)
    size = dtypes.itemsize(dtype_name)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=n * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw %= 2
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def make_view(dtype_name: str, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """A tensor of `shape` that is (usually) not a plain contiguous tensor."""
    nd = len(shape)
    if kind == "transpose" and nd >= 2:
        base = random_tensor(dtype_name, tuple(reversed(shape)), seed)
        return base.permute(*reversed(range(nd)))
    if kind == "step" and nd >= 1:
        base_shape = (*shape[:-1], shape[-1] * 3 + 1)
        return random_tensor(dtype_name, base_shape, seed)[..., 1::3]
    if kind == "expand" and nd >= 1:
        base = random_tensor(dtype_name, (1, *shape[1:]), seed)
        return base.expand(*shape)
    if kind == "offset":
        n = math.prod(shape)
        return random_tensor(dtype_name, (n + 5,), seed)[3 : 3 + n].view(shape)
    if kind == "conj" and dtypes.from_name(dtype_name).is_complex:
        return random_tensor(dtype_name, shape, seed).conj()
    return random_tensor(dtype_name, shape, seed)


tensors = st.builds(
    make_view,
    st.sampled_from(DTYPE_NAMES),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from(["plain", "transpose", "step", "expand", "offset", "conj"]),
    st.integers(0, 2**32 - 1),
)

np_arrays = st.builds(
    lambda a, kind: a.T if kind == "T" else (a[::2] if kind == "step" and a.ndim else a),
    npst.arrays(
        st.sampled_from(NP_DTYPES),
        npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    st.sampled_from(["plain", "T", "step"]),
)
np_scalars = npst.arrays(st.sampled_from(NP_DTYPES), shape=()).map(lambda a: a[()])

plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**2000), max_value=2**2000),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, -(10**300), 10**1000]),
    st.floats(),
    st.sampled_from(
        [math.nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]
    ),
    st.text(),
    st.binary(max_size=64),
)

# dict keys: every scalar kind ckptd allows; NUL-free (see test_key_with_nul) and nan-free
# (nan != nan, so a nan key cannot be matched against a preallocated target).
keys = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=10),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.binary(max_size=8),
)

leaves = st.one_of(tensors, tensors, plain, np_arrays, np_scalars)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)
states = st.dictionaries(keys, trees, max_size=5)


def _walk(obj: Any):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def expected_entries(state: Any) -> int:
    """Stored tensors: one per distinct non-empty tensor, one per array/scalar/empty tensor."""
    seen: set[int] = set()
    n = 0
    for v in _walk(state):
        if isinstance(v, torch.Tensor):
            if v.numel() == 0:
                n += 1
            elif id(v) not in seen:
                seen.add(id(v))
                n += 1
        elif isinstance(v, (np.ndarray, np.generic)):
            n += 1
    return n


# ----------------------------------------------------------------------------- property


@given(
    state=states,
    step=st.integers(0, layout.MAX_STEP),
    shared=st.one_of(st.none(), tensors.filter(lambda t: t.numel() > 0)),
)
def test_roundtrip_property(tmp_path, state, step, shared):
    if shared is not None:
        state["shared_a"] = shared
        state["shared_b"] = {"again": shared}
    d = tempfile.mkdtemp(dir=tmp_path)
    try:
        res = ckpt.save(state, d, step=step)
        assert res.step == step
        assert res.path.endswith(layout.step_dir(step))

        entries = index_entries(d, step)
        assert len(entries) == expected_entries(state)
        assert len({e["key"] for e in entries}) == len(entries)

        into_empty: dict[Any, Any] = {}
        lr = ckpt.load(into_empty, d)
        assert lr.step == step
        assert lr.state is into_empty
        assert_same(into_empty, state)

        target = zeroed_like(state)
        ckpt.load(target, d, step=step)
        assert_same(target, state)

        if shared is not None:
            assert sum(e["key"].startswith("shared_") for e in entries) == 1
            assert into_empty["shared_a"] is into_empty["shared_b"]["again"]
            assert target["shared_a"] is target["shared_b"]["again"]
    finally:
        shutil.rmtree(d)


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_every_layout(job, name):
    state = {
        "scalar": random_tensor(name, (), 1),
        "empty": random_tensor(name, (0, 3), 2),
        "vector": random_tensor(name, (17,), 3),
        "transposed": make_view(name, (3, 5), "transpose", 4),
        "strided": make_view(name, (2, 4), "step", 5),
        "expanded": make_view(name, (4, 3), "expand", 6),
        "offset": make_view(name, (2, 3), "offset", 7),
        "conj": make_view(name, (3,), "conj", 8),
    }
    assert not state["transposed"].is_contiguous()
    assert not state["strided"].is_contiguous()
    ckpt.save(state, job, step=1)
    for e in index_entries(job, 1):
        assert e["dtype"] == name
        assert e["offset"] % 4096 == 0
    out = ckpt.load({}, job).state
    assert_same(out, state)
    for v in out.values():
        assert v.is_contiguous()
    target = zeroed_like(state)
    ckpt.load(target, job)
    assert_same(target, state)


def test_tensors_are_filled_in_place(job):
    state = {"w": torch.randn(4, 4), "b": torch.arange(3)}
    ckpt.save(state, job, step=3)
    w, b = torch.zeros(4, 4), torch.zeros(3, dtype=torch.int64)
    target = {"w": w, "b": b}
    ckpt.load(target, job)
    assert target["w"] is w and target["b"] is b
    assert_same(target, state)


def test_non_contiguous_target_is_filled(job):
    src = torch.randn(3, 5)
    ckpt.save({"w": src}, job, step=1)
    holder = torch.zeros(5, 3)
    target = {"w": holder.T}
    ckpt.load(target, job)
    assert torch.equal(holder.T, src)


def test_plain_values(job):
    state = {
        "none": None,
        "true": True,
        "false": False,
        "zero": 0,
        "huge": 2**1000,
        "neg_huge": -(10**1000),
        "u64": 2**64 - 1,
        "nan": math.nan,
        "neg_nan": -math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "negzero": -0.0,
        "denormal": 5e-324,
        "str": "héllo wörld ☃ 🎉 \u202eltr \x00 nul",
        "lone_surrogate": "\ud800",
        "empty": "",
        "bytes": bytes(range(256)),
        "empty_bytes": b"",
        "tuple": (1, (2.5, "x"), ()),
        "list": [[], [None], {"k": ()}],
        "int_keys": {0: "a", -7: "b", 2**70: "c"},
        "mixed_keys": {None: 1, True: 2, 1.5: 3, b"\x00k": 4, "s": 5, -0.0: 6},
        "arrays": {
            "f64": np.array([math.nan, -0.0, math.inf]),
            "0d": np.array(3, dtype=np.int16),
            "empty": np.zeros((0, 2), dtype=np.uint32),
            "bool": np.array([[True, False]]),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
            "strided": np.arange(20, dtype=np.float32)[::3],
            "bigendian": np.arange(4, dtype=">i4").astype(np.int32),
        },
    }
    ckpt.save(state, job, step=5, metadata={"note": "plain"})
    lr = ckpt.load({}, job)
    assert lr.metadata == {"note": "plain"}
    assert_same(lr.state, state)
    assert isinstance(lr.state["tuple"][1], tuple)
    assert list(lr.state["int_keys"]) == [0, -7, 2**70]


NP_SCALARS = {
    "f32": np.float32(1.5),
    "f16": np.float16(-0.0),
    "i64": np.int64(-(2**63)),
    "u64": np.uint64(2**64 - 1),
    "bool": np.bool_(True),
    "c128": np.complex128(1 - 2j),
    "nan": np.float64("nan"),
    "i8": np.int8(-3),
}


def test_numpy_scalars_keep_their_type(job):
    ckpt.save({"np": NP_SCALARS}, job, step=1)
    out = ckpt.load({}, job).state["np"]
    for k, v in NP_SCALARS.items():
        assert type(out[k]) is type(v), k
        assert out[k].dtype == v.dtype, k


def test_numpy_scalars_load_their_values(job):
    ckpt.save({"np": NP_SCALARS}, job, step=1)
    for _ in range(3):
        # Freed small numpy buffers are reused by the next np.empty of the same size:
        # fill them with something else first, so stale memory cannot pass for the value.
        poison = [np.full((), 77, dtype=v.dtype) for v in NP_SCALARS.values() for _ in range(8)]
        del poison
        assert_same(ckpt.load({}, job).state, {"np": NP_SCALARS})


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1, 4)[:, 2],
        lambda: torch.randn(3)[1::3],
        lambda: torch.randn(2, 6)[:1, ::6],
    ],
    ids=["column-of-1-row", "step-slice-of-1", "1x1-strided"],
)
def test_size_one_view_saves(job, make):
    t = make()
    assert t.is_contiguous() and t.stride()[-1] != 1
    ckpt.save({"t": t}, job, step=1)
    assert_same(ckpt.load({}, job).state, {"t": t})


def test_load_into_size_one_strided_target(job):
    src = torch.randn(1)
    ckpt.save({"c": src}, job, step=1)
    holder = torch.zeros(1, 4)
    ckpt.load({"c": holder[:, 2]}, job)
    assert holder[0, 2].item() == src.item()


def test_big_endian_array_keeps_its_values(job):
    a = np.arange(6, dtype=">f8").reshape(2, 3)
    ckpt.save({"a": a}, job, step=1)
    out = ckpt.load({}, job).state["a"]
    assert isinstance(out, np.ndarray)
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)


@pytest.mark.parametrize(
    "root",
    [
        [torch.arange(3), 1, "x"],
        (torch.ones(2), None),
        torch.arange(6).reshape(2, 3),
        np.arange(3),
        42,
        "just a string",
    ],
    ids=["list", "tuple", "tensor", "ndarray", "int", "str"],
)
def test_roots_that_are_not_dicts(job, root):
    ckpt.save(root, job, step=1)
    assert_same(ckpt.load(None, job).state, root)


class Counter:
    """A user object with state_dict/load_state_dict (ckptd's Stateful protocol)."""

    def __init__(self) -> None:
        self.n = 0
        self.hist = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.hist.copy_(sd["hist"])


def test_stateful_objects(job):
    c = Counter()
    c.n = 7
    c.hist = torch.tensor([1.0, 2.0, 3.0])
    ckpt.save({"counter": c}, job, step=1)
    fresh = Counter()
    target = {"counter": fresh}
    ckpt.load(target, job)
    assert target["counter"] is fresh
    assert fresh.n == 7
    assert torch.equal(fresh.hist, c.hist)
    # Without an object to receive it, the plain state comes back.
    assert_same(ckpt.load({}, job).state, {"counter": {"n": 7, "hist": c.hist}})


# ----------------------------------------------------------------------------- sharing


def test_shared_tensor_is_stored_once(job):
    t = torch.randn(8, 8)
    state = {"a": t, "b": t, "nested": {"c": [t]}, "other": t.clone()}
    ckpt.save(state, job, step=1)
    keys = [e["key"] for e in index_entries(job, 1)]
    assert sorted(keys) == ["a", "other"]
    out = ckpt.load({}, job).state
    assert out["a"] is out["b"] is out["nested"]["c"][0]
    assert out["other"] is not out["a"]
    assert_same(out, state)


def test_shared_tensor_into_separate_targets(job):
    t = torch.randn(5)
    ckpt.save({"a": t, "b": t}, job, step=1)
    a, b = torch.zeros(5), torch.zeros(5)
    ckpt.load({"a": a, "b": b}, job)
    assert torch.equal(a, t) and torch.equal(b, t)


def test_views_of_one_storage_are_distinct_entries(job):
    base = torch.randn(4, 4)
    state = {"full": base, "t": base.T, "row": base[1], "same_view": base.view(4, 4)}
    ckpt.save(state, job, step=1)
    keys = sorted(e["key"] for e in index_entries(job, 1))
    # base and base.view(4, 4) have the same storage, offset, shape and strides: one entry.
    assert keys == ["full", "row", "t"]
    out = ckpt.load({}, job).state
    assert out["same_view"] is out["full"]
    assert_same(out, {k: v for k, v in state.items()})


def test_tied_module_weights(job):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    ckpt.save({"model": model}, job, step=1)
    assert len(index_entries(job, 1)) == 1
    emb2 = torch.nn.Embedding(10, 4)
    head2 = torch.nn.Linear(4, 10, bias=False)
    head2.weight = emb2.weight
    model2 = torch.nn.ModuleDict({"emb": emb2, "head": head2})
    ckpt.load({"model": model2}, job)
    assert torch.equal(model2["emb"].weight, emb.weight)
    assert model2["head"].weight is model2["emb"].weight


# ----------------------------------------------------------------------------- keys


def test_colliding_key_paths_stay_apart(job):
    state = {
        1: torch.ones(1),
        "1": torch.zeros(1),
        "1#1": torch.full((1,), 2.0),
        "a/b": torch.ones(2),
        "a": {"b": torch.zeros(2)},
    }
    ckpt.save(state, job, step=1)
    keys = [e["key"] for e in index_entries(job, 1)]
    assert len(set(keys)) == 5
    assert_same(ckpt.load({}, job).state, state)


def _save_or_refuse(state: Any, job: str, key_hint: str) -> bool:
    """Save; a refusal must be UnsupportedValue naming the key. True when it saved."""
    try:
        ckpt.save(state, job, step=1)
    except ckpt.UnsupportedValue as e:
        assert key_hint in str(e)
        assert not os.path.exists(step_path(job, 1))
        return False
    return True


def test_key_with_nul(job):
    state = {"a\x00b": torch.ones(2)}
    if _save_or_refuse(state, job, "a"):
        assert_same(ckpt.load({}, job).state, state)


def test_key_longer_than_the_parser_accepts(job):
    state = {"k" * 5000: torch.ones(2)}
    if _save_or_refuse(state, job, "kkkk"):
        assert_same(ckpt.load({}, job).state, state)


def test_nesting_within_the_limit(job):
    state: Any = torch.arange(3)
    for i in range(100):
        state = {f"l{i}": state} if i % 2 else [state]
    ckpt.save({"deep": state}, job, step=1)
    assert_same(ckpt.load({}, job).state, {"deep": state})


def test_nesting_beyond_the_parser_limit(job):
    state: Any = torch.ones(1)
    for _ in range(300):
        state = {"x": state}
    if _save_or_refuse(state, job, "x/x/x"):
        assert_same(ckpt.load({}, job).state, state)


def test_int_beyond_str_digit_limit(job):
    state = {"counter": {"big": 10**5000}}
    if _save_or_refuse(state, job, "counter/big"):
        assert_same(ckpt.load({}, job).state, state)


def test_steps_are_independent(job):
    states = {s: {"w": torch.full((3,), float(s)), "s": s} for s in (0, 1, 10**12 - 1)}
    for s, st_ in states.items():
        ckpt.save(st_, job, step=s)
    for s, st_ in states.items():
        assert_same(ckpt.load({}, job, step=s).state, st_)
    assert ckpt.load({}, job).step == 10**12 - 1


def test_loaded_tensor_bytes_helper_is_exact():
    # The comparison helper itself must see a single flipped bit, nan payloads and -0.0.
    a = torch.tensor([math.nan, -0.0, 1.0])
    b = a.clone()
    assert tensor_raw(a) == tensor_raw(b)
    b.view(torch.int32)[0] ^= 1
    assert tensor_raw(a) != tensor_raw(b)
    with pytest.raises(AssertionError):
        assert_same({"x": 0.0}, {"x": -0.0})
    with pytest.raises(AssertionError):
        assert_same((1,), [1])
    with pytest.raises(AssertionError):
        assert_same(np.float32(1), np.float64(1))


def test_all_dtypes_in_one_state(job):
    state = {
        f"{name}/{kind}": make_view(name, shape, kind, seed)
        for seed, (name, (shape, kind)) in enumerate(
            itertools.product(DTYPE_NAMES, [((2, 3), "transpose"), ((), "plain")])
        )
    }
    ckpt.save(state, job, step=1)
    assert_same(ckpt.load({}, job).state, state)


def test_per_rank_values_in_a_single_process(job):
    rng = torch.get_rng_state()
    state = {"rng": ckpt.PerRank(rng), "plain": ckpt.PerRank({"seed": 3, "t": (1, 2.5)})}
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job).state
    assert_same(out, {"rng": rng, "plain": {"seed": 3, "t": (1, 2.5)}})
    holder = ckpt.PerRank(torch.zeros_like(rng))
    target = {"rng": holder, "plain": ckpt.PerRank(None)}
    ckpt.load(target, job)
    assert target["rng"] is holder
    assert_same(holder.value, rng)
    assert target["plain"].value == {"seed": 3, "t": (1, 2.5)}


@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=8),
    block=st.sampled_from([4096, 8192]),
    window=st.sampled_from([4096, 8192, 12288, 1 << 20]),
    direct_io=st.booleans(),
    threads=st.sampled_from([1, 3]),
    verify=st.sampled_from(["full", "size"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_windows_blocks_and_io_paths(
    tmp_path, sizes, block, window, direct_io, threads, verify, seed
):
    """Small hash blocks and I/O windows: entries split across windows and blocks, read
    back through coalesced ranged reads, with O_DIRECT and buffered I/O."""
    rng = np.random.default_rng(seed)
    state = {
        f"t{i}": torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
        for i, n in enumerate(sizes)
    }
    d = tempfile.mkdtemp(dir=tmp_path)
    try:
        with knobs.override(block_size=block, io_window=window, direct_io=direct_io):
            ckpt.save(state, d, step=1, io_threads=threads, verify=verify)
            out = ckpt.load({}, d, io_threads=threads).state
        assert_same(out, state)
        for e in index_entries(d, 1):
            assert len(e["blake3"]) == -(-e["length"] // block)
    finally:
        shutil.rmtree(d)


def test_path_objects_and_unusual_job_names(tmp_path):
    job = tmp_path / "runs" / "my job ☃ (1)"
    state = {"w": torch.arange(4)}
    ckpt.save(state, job, step=1)
    assert_same(ckpt.load({}, job).state, state)
    assert_same(ckpt.load({}, str(job)).state, state)
    assert_same(ckpt.load({}, f"file://{job}").state, state)
