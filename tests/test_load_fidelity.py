"""What a load into `{}` gives back besides the values (docs/concepts.md "What a load restores").

Views of one storage share it again (tied weights that are views, slices of one flat
buffer), requires_grad and nn.Parameter survive, other tensor subclasses come back as
plain tensors with the same values; loads into the state's own tensors are unchanged, and
manifests without the new fields load as before. Crafted fields are refused as
InvalidManifest (counted in the reliability report as `manifest-field`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ckpt_testutil import edit_manifest, manifest_path, read_json

import ckpt
from ckptd.format import checkpoint as ckfmt
from ckptd.format import values
from ckptd.storage import open_storage


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def tensor_bodies(doc: dict[str, Any]) -> dict[str, Any]:
    """Top-level key -> the body of its tensor node in a manifest's state."""
    return {k: v["tensor"] for k, v in doc["state"]["dict"] if "tensor" in v}


# ----------------------------------------------------------------------------- bytes
def odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose bytes a flatten takes in each of its ways: every dtype class, 0-d,
    empty, size-1 dimensions with odd strides (torch still calls them contiguous), slices
    at an offset, transposes, conj/neg views, a Parameter."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    z = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    col = torch.randn(5, 1, generator=g)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f64": base.double(),
        "i64": torch.arange(12).reshape(3, 4),
        "u8": torch.arange(7, dtype=torch.uint8),
        "bool": base > 0,
        "c64": z,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "one": torch.ones(1),
        "row-of-a-column": col.t(),  # shape (1, 5), stride (1, 1)
        "size-1-odd-stride": base[2:3, :].as_strided((1, 8), (100, 1), 16),
        "column": col,
        "slice-at-offset": base[2:4],
        "transposed": base.t(),
        "strided": base[:, ::2],
        "conj": z.conj(),
        "neg": base._neg_view(),
        "parameter": torch.nn.Parameter(base.clone()),
    }


def test_the_bytes_a_flatten_takes_are_each_tensors_own_and_a_view_where_dense() -> None:
    from ckpt._flatten import flatten, tensor_bytes

    state = odd_tensors()
    _, leaves = flatten(state)
    by_key = {leaf.key: leaf for leaf in leaves}
    for name, t in state.items():
        leaf = by_key[name]
        want = tensor_bytes(t)
        assert leaf.data.dtype == want.dtype and leaf.data.shape == want.shape, name
        assert leaf.data.tobytes() == want.tobytes(), name
        dense = t.is_contiguous() and not t.is_conj() and not t.is_neg() and t.numel() > 0
        if dense:  # the tensor's own memory, not a copy
            assert leaf.data.ctypes.data == t.data_ptr(), name


# ----------------------------------------------------------------------------- views


def test_tied_transposed_views_share_storage_after_a_load_into_empty(job: str) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ckpt.save({"a": w, "b": w.t()}, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w.t())
    assert shares(out["a"], out["b"])
    out["a"][0, 1] = 100.0
    assert out["b"][1, 0] == 100.0
    assert out["b"].stride() == (1, 4)


def test_a_tensor_under_two_keys_and_its_view_share_storage_again(job: str) -> None:
    """The same tensor twice is one leaf with two nodes; each node gets the view's place
    in the storage it shares with a transposed view (the flattener keeps a list of nodes,
    and of a storage's leaves, only when there is a second)."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ckpt.save({"a": w, "again": w, "b": w.t()}, job, step=1)
    nodes = dict(read_json(manifest_path(job, 1))["state"]["dict"])
    assert nodes["again"] == nodes["a"] and "view" in nodes["a"]["tensor"], nodes
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["again"], w) and torch.equal(out["b"], w.t())
    assert shares(out["a"], out["again"]) and shares(out["a"], out["b"])
    out["again"][0, 1] = 100.0
    assert out["a"][0, 1] == 100.0 and out["b"][1, 0] == 100.0


def test_slices_of_one_flat_buffer_share_it_again(job: str) -> None:
    buf = torch.arange(20, dtype=torch.float64)
    ckpt.save({"x": buf[:10], "y": buf[10:], "step": 3}, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["x"], buf[:10]) and torch.equal(out["y"], buf[10:])
    assert out["step"] == 3
    assert shares(out["x"], out["y"])
    # One buffer, in the saved order: y starts where x ends.
    assert out["y"].data_ptr() - out["x"].data_ptr() == 10 * 8
    out["y"].add_(1)
    assert torch.equal(out["x"], buf[:10])  # disjoint views: only y changed


def test_padded_flat_buffer_and_the_buffer_itself(job: str) -> None:
    # FSDP-style: parameters are views of one flat buffer with padding between them, and
    # the flat buffer itself is saved too.
    flat = torch.arange(32, dtype=torch.float32)
    state = {"flat": flat, "w": flat[:12].view(3, 4), "b": flat[16:20], "c": flat[24:30]}
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job, step=1).state
    for k in state:
        assert torch.equal(out[k], state[k]), k
        assert shares(out[k], out["flat"]), k
    out["flat"].zero_()
    assert not out["w"].any() and not out["b"].any() and not out["c"].any()


def test_views_of_another_dtype_share_the_bytes(job: str) -> None:
    f = torch.arange(8, dtype=torch.float32)
    state = {"f": f, "bits": f.view(torch.int32), "half": f[4:]}
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["bits"], f.view(torch.int32))
    assert shares(out["f"], out["bits"]) and shares(out["f"], out["half"])
    out["f"][0] = 1.5
    assert out["bits"][0] == torch.tensor(1.5).view(torch.int32)


def test_views_restored_through_a_checkpointer(tmp_path: Any) -> None:
    w = torch.randn(5, 3)
    with ckpt.Checkpointer(tmp_path / "job") as cp:
        cp.save({"model": {"emb": w, "head": w.t()}}, step=1).wait()
        out = cp.load({}, step=1).state
    assert torch.equal(out["model"]["head"], w.t())
    assert shares(out["model"]["emb"], out["model"]["head"])


def test_a_partial_load_of_one_view(job: str) -> None:
    w = torch.randn(4, 4)
    ckpt.save({"a": w, "b": w.t(), "c": w[1]}, job, step=1)
    out = ckpt.load({}, job, step=1, keys="b").state
    assert list(out) == ["b"] and torch.equal(out["b"], w.t())


def test_views_far_apart_come_back_independent(job: str) -> None:
    # Mostly bytes no key holds: not worth a buffer that size (documented).
    big = torch.arange(1000, dtype=torch.float32)
    ckpt.save({"head": big[:4], "tail": big[-4:]}, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["head"], big[:4]) and torch.equal(out["tail"], big[-4:])
    assert not shares(out["head"], out["tail"])
    assert out["head"].untyped_storage().nbytes() == 16


def test_conjugate_negative_and_expanded_views_keep_their_values(job: str) -> None:
    # z.conj() and z.conj().imag (a negative view) share z's storage, offset and shape
    # but not its values: they were once stored as z itself.
    z = torch.randn(3, dtype=torch.complex64)
    one = torch.ones(1)
    state = {"z": z, "zc": z.conj(), "zci": z.conj().imag, "one": one, "wide": one.expand(5)}
    assert state["zci"].is_neg()
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["zc"], torch.conj_physical(z))
    assert torch.equal(out["zci"], -z.imag)
    for k in state:
        assert torch.equal(out[k], state[k].resolve_conj().resolve_neg()), k


# ----------------------------------------------------------------------------- grad, classes


def test_requires_grad_and_parameters_survive_a_load_into_empty(job: str) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    state = {"p": p, "again": p, "frozen": frozen, "g": torch.ones(2, requires_grad=True)}
    state["plain"] = torch.zeros(2)
    state["ints"] = torch.arange(3)
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert out["again"] is out["p"]
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["g"]) is torch.Tensor and out["g"].requires_grad and out["g"].is_leaf
    assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
    assert not out["ints"].requires_grad
    for k in state:
        assert torch.equal(out[k].detach(), state[k].detach()), k
    # A restored parameter trains: it is a leaf of autograd.
    (out["p"] * 2).sum().backward()
    assert out["p"].grad is not None and torch.equal(out["p"].grad, torch.full((3,), 2.0))


def test_named_parameters_of_a_module_with_tied_view(job: str) -> None:
    lin = torch.nn.Linear(4, 3)
    state = {"weight": lin.weight, "weight_t": lin.weight.t(), "bias": lin.bias}
    ckpt.save(state, job, step=1)
    out = ckpt.load({}, job, step=1).state
    assert isinstance(out["weight"], torch.nn.Parameter) and out["weight"].requires_grad
    # A view of a parameter is not a parameter; it requires grad and shares its storage.
    assert type(out["weight_t"]) is torch.Tensor and out["weight_t"].requires_grad
    assert shares(out["weight"], out["weight_t"])
    assert torch.equal(out["weight_t"].detach(), lin.weight.detach().t())


class _Tagged(torch.Tensor):
    pass


def test_a_tensor_subclass_comes_back_as_a_plain_tensor(job: str) -> None:
    t = torch.arange(6, dtype=torch.float32).as_subclass(_Tagged)
    ckpt.save({"t": t}, job, step=1)
    doc = read_json(manifest_path(job, 1))
    assert "_Tagged" not in str(doc)  # no class names in storage: nothing to import
    out = ckpt.load({}, job, step=1).state
    assert type(out["t"]) is torch.Tensor
    assert torch.equal(out["t"], torch.arange(6, dtype=torch.float32))


# ----------------------------------------------------------------------------- unchanged


def test_in_place_loads_keep_the_states_own_tensors(job: str) -> None:
    w = torch.randn(3, 4)
    ckpt.save({"a": w, "b": w.t(), "p": torch.nn.Parameter(torch.ones(2))}, job, step=1)
    a, b, p = torch.zeros(3, 4), torch.zeros(4, 3), torch.zeros(2)
    state = {"a": a, "b": b, "p": p}
    out = ckpt.load(state, job, step=1).state
    assert out is state and state["a"] is a and state["b"] is b and state["p"] is p
    assert torch.equal(a, w) and torch.equal(b, w.t()) and torch.equal(p, torch.ones(2))
    assert not shares(a, b) and type(p) is torch.Tensor and not p.requires_grad


def test_a_models_own_state_dict_keeps_its_parameters(job: str) -> None:
    model = torch.nn.Linear(4, 2)
    ckpt.save({"model": model}, job, step=1)
    fresh = torch.nn.Linear(4, 2)
    weight = fresh.weight
    ckpt.load({"model": fresh}, job, step=1)
    assert fresh.weight is weight and fresh.weight.requires_grad
    assert torch.equal(fresh.weight, model.weight)


def test_state_dicts_are_saved_as_before(job: str) -> None:
    # model.state_dict() holds detached, non-parameter tensors: their nodes keep the plain
    # {"tensor": key} form, so such checkpoints read the same in every ckptd version.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ckpt.save({"model": model.state_dict(), "n": torch.ones(2)}, job, step=1)
    doc = read_json(manifest_path(job, 1))
    refs = [leaf["tensor"] for leaf in values.leaves(doc["state"]) if values.tensor_ref(leaf)]
    assert refs and all(isinstance(body, str) for body in refs)


def test_manifests_without_the_fields_load_as_before(job: str) -> None:
    # A checkpoint written before these fields: every tensor node is {"tensor": key}.
    w = torch.randn(3, 4)
    p = torch.nn.Parameter(torch.randn(2))
    ckpt.save({"a": w, "b": w.t(), "p": p}, job, step=1)

    def strip(m: dict[str, Any]) -> None:
        for pair in m["state"]["dict"]:
            body = pair[1]["tensor"]
            if isinstance(body, dict):
                pair[1] = {"tensor": body["key"]}

    edit_manifest(job, 1, strip)
    assert all(isinstance(b, str) for b in tensor_bodies(read_json(manifest_path(job, 1))).values())
    out = ckpt.load({}, job, step=1).state
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w.t())
    assert not shares(out["a"], out["b"])
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad


# ----------------------------------------------------------------------------- crafted fields


def _tied(job: str) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ckpt.save({"a": w, "b": w.t(), "n": torch.arange(4)}, job, step=1)


def _set(key: str, fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        for pair in m["state"]["dict"]:
            if pair[0] == key:
                body = pair[1]["tensor"]
                if isinstance(body, str):
                    body = pair[1]["tensor"] = {"key": body}
                fn(body)

    return edit


def _view(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda body: body["view"].update(fields)


# Refused when the manifest is parsed (values.check_node).
AT_PARSE = {
    "offset-too-large": ("b", _view(offset=1 << 62)),
    "offset-negative": ("b", _view(offset=-1)),
    "offset-a-string": ("b", _view(offset="0")),
    "offset-a-bool": ("b", _view(offset=True)),
    "stride-negative": ("b", _view(stride=[1, -4])),
    "stride-too-large": ("b", _view(stride=[1, 1 << 62])),
    "stride-not-a-list": ("b", _view(stride=4)),
    "stride-too-many-dims": ("b", _view(stride=[1] * 65)),
    "storage-empty": ("b", _view(storage="")),
    "storage-not-a-string": ("b", _view(storage=7)),
    "view-extra-field": ("b", _view(dtype="int8")),
    "view-missing-field": ("b", lambda body: body["view"].pop("stride")),
    "view-not-an-object": ("b", lambda body: body.__setitem__("view", [0, 1])),
    "unknown-tensor-field": ("a", lambda body: body.__setitem__("pickle", "x")),
    "key-missing": ("a", lambda body: body.pop("key")),
    "requires-grad-not-bool": ("a", lambda body: body.__setitem__("requires_grad", 1)),
    "parameter-not-bool": ("a", lambda body: body.__setitem__("parameter", "yes")),
}


def _placed_twice(m: dict[str, Any]) -> None:
    # A second reference to "a", placed elsewhere in the same storage.
    view = {"storage": "a", "offset": 1, "stride": [4, 1]}
    m["state"]["dict"].append(["a2", {"tensor": {"key": "a", "view": view}}])


# Refused when a load plans, before any tensor memory is allocated (values.view_groups,
# against the entries' shapes); in-place loads check them too.
AT_PLAN = {
    "stride-wrong-rank": _set("b", _view(stride=[1])),
    "stride-overlapping": _set("b", _view(stride=[0, 4])),
    "offset-far-out": _set("b", _view(offset=1 << 40)),
    "stride-far-out": _set("b", _view(stride=[1, 1 << 40])),
    "placed-twice": _placed_twice,
}


@pytest.mark.parametrize("case", sorted(AT_PARSE))
def test_crafted_tensor_fields_are_refused_when_parsed(job: str, tally: Any, case: str) -> None:
    _tied(job)
    edit_manifest(job, 1, _set(*AT_PARSE[case]))
    with tally.bad_input("manifest-field"):
        with pytest.raises(ckpt.InvalidManifest, match="tensor"):
            ckfmt.open_checkpoint(open_storage(job), 1)
        with pytest.raises(ckpt.InvalidManifest):
            ckpt.load({}, job, step=1)


@pytest.mark.parametrize("case", sorted(AT_PLAN))
def test_crafted_views_are_refused_before_any_read(job: str, tally: Any, case: str) -> None:
    _tied(job)
    edit_manifest(job, 1, AT_PLAN[case])
    with tally.bad_input("manifest-field"):
        with pytest.raises(ckpt.InvalidManifest, match="step 1") as ei:
            ckpt.load({}, job, step=1)
        assert "'a'" in str(ei.value) or "'b'" in str(ei.value), ei.value
        target = {"a": torch.zeros(3, 4), "b": torch.zeros(4, 3), "n": torch.zeros(4)}
        with pytest.raises(ckpt.InvalidManifest):
            ckpt.load(target, job, step=1)
        assert not target["a"].any()  # nothing was read


def test_requires_grad_on_an_integer_tensor_is_refused(job: str, tally: Any) -> None:
    _tied(job)
    edit_manifest(job, 1, _set("n", lambda body: body.__setitem__("requires_grad", True)))
    with tally.bad_input("manifest-field"):
        with pytest.raises(ckpt.InvalidManifest, match="'n' is marked requires_grad"):
            ckpt.load({}, job, step=1)
    # A load into the state's own tensors keeps their flags and does not look at it.
    n = torch.zeros(4, dtype=torch.int64)
    ckpt.load({"a": torch.zeros(3, 4), "b": torch.zeros(4, 3), "n": n}, job, step=1)
    assert torch.equal(n, torch.arange(4))
