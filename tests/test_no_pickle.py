"""No code from data (design promise 5): nothing in ckptd or the client can unpickle.

A static check over every .py file under ckptd/ and clients/: no pickle, marshal,
shelve, dill or cloudpickle (imported, used, or imported by name), no torch.load without
weights_only=True, no weights_only=False, no numpy allow_pickle=True. Prose in comments
and docstrings may mention pickle; code may not. The checker is tested on snippets too.

And the other side of the promise: values ckptd cannot store without pickle are refused
with UnsupportedValue naming their key, and nothing is written.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_testutil import assert_same, list_files, step_path

import ckpt

REPO = Path(__file__).resolve().parent.parent
ROOTS = [REPO / "ckptd", REPO / "clients"]
FORBIDDEN = {
    "pickle",
    "cPickle",
    "_pickle",
    "pickletools",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def problems_in(source: str, name: str = "<snippet>") -> list[str]:
    out: list[str] = []
    tree = ast.parse(source, name)
    torch_load_names = {"torch.load"}
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FORBIDDEN:
                    out.append(f"{where}: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in FORBIDDEN:
                out.append(f"{where}: from {node.module} import ...")
            if node.module == "torch":
                for a in node.names:
                    if a.name == "load":
                        torch_load_names.add(a.asname or "load")
        elif isinstance(node, ast.Call):
            fn = _dotted(node.func)
            if fn in ("__import__", "importlib.import_module", "import_module"):
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in FORBIDDEN:
                        out.append(f"{where}: {fn}({arg.value!r})")
            kw = {k.arg: k.value for k in node.keywords}
            if fn in torch_load_names:
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append(f"{where}: {fn}(...) without weights_only=True")
            if fn.endswith("read_pickle") or fn.endswith("to_pickle"):
                out.append(f"{where}: {fn}(...)")
        elif isinstance(node, ast.keyword):
            if (
                node.arg == "weights_only"
                and isinstance(node.value, ast.Constant)
                and node.value.value is False
            ):
                out.append(f"{where}: weights_only=False")
            if node.arg == "allow_pickle" and not (
                isinstance(node.value, ast.Constant) and node.value.value is False
            ):
                out.append(f"{where}: allow_pickle={ast.unparse(node.value)}")
        elif isinstance(node, ast.Attribute) and _dotted(node).split(".")[0] in FORBIDDEN:
            out.append(f"{where}: {_dotted(node)}")
    # Any code token (not a comment or string) naming a forbidden module.
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in FORBIDDEN:
            out.append(f"{name}:{tok.start[0]}: name {tok.string!r} in code")
    return sorted(set(out))


def python_files() -> list[Path]:
    files = []
    for root in ROOTS:
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", ".venv", "build")]
            files += [Path(d) / n for n in names if n.endswith(".py")]
    return sorted(files)


def test_there_is_code_to_check():
    names = {p.name for p in python_files()}
    assert {"manifest.py", "values.py", "_api.py", "_restore.py", "_flatten.py"} <= names


def test_no_pickle_in_ckptd_or_client():
    found = []
    for path in python_files():
        found += problems_in(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, "pickle-capable code found:\n  " + "\n  ".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import pickle as p",
        "import cPickle",
        "from pickle import loads",
        "import marshal",
        "import shelve",
        "import dill",
        "import cloudpickle",
        "from dill import loads",
        "x = pickle.loads(b'')",
        "__import__('pickle')",
        "importlib.import_module('marshal')",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
        "torch.load(f, map_location='cpu')",
        "from torch import load\nload(f)",
        "np.load(f, allow_pickle=True)",
        "pd.read_pickle(f)",
        "m = marshal",
    ],
)
def test_checker_catches(snippet):
    assert problems_in(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(f, weights_only=True)",
        "np.load(f, allow_pickle=False)",
        "# never import pickle here\nx = 1",
        '"""there is no pickle fallback; pickle.loads is not used"""',
        "msg = 'cannot be stored without pickle'",
        "json.loads(data)",
    ],
)
def test_checker_allows(snippet):
    assert problems_in(snippet) == []


# ----------------------------------------------------------------------------- refusals


class Opaque:
    pass


class Slotted:
    __slots__ = ("x",)


UNSUPPORTED = {
    "set": {1, 2},
    "frozenset": frozenset({1}),
    "object": Opaque(),
    "lambda": lambda x: x,
    "function": print,
    "class": Opaque,
    "generator": (i for i in range(3)),
    "complex": 1 + 2j,
    "object-array": np.array([1, "a", None], dtype=object),
    "string-array": np.array(["a", "bc"]),
    "structured-array": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
    "datetime-array": np.array(["2024-01-01"], dtype="datetime64[D]"),
    "longdouble": np.zeros(2, dtype=np.longdouble),
    "np-str-scalar": np.str_("x"),
    "sparse-tensor": torch.eye(3).to_sparse(),
    "meta-tensor": torch.empty(3, device="meta"),
    "device": torch.device("cpu"),
    "dtype": torch.float32,
    "slotted": Slotted(),
    "ellipsis": ...,
    "range": range(3),
}


@pytest.mark.parametrize("value", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_values_are_refused_with_their_key(job, value):
    good = {"w": torch.ones(3), "n": 1}
    ckpt.save(good, job, step=1)
    state: dict[str, Any] = {
        "w": torch.zeros(3),
        "model": {"layers": [{"ok": 1}, {"bad_value": value}]},
    }
    with pytest.raises(ckpt.UnsupportedValue) as ei:
        ckpt.save(state, job, step=2)
    assert "model/layers/1/bad_value" in str(ei.value)
    assert isinstance(ei.value, TypeError)
    # Nothing was written for the refused step; the previous one is intact.
    assert not os.path.exists(step_path(job, 2))
    assert_same(ckpt.load({}, job).state, good)


@pytest.mark.parametrize(
    "key",
    [(1, 2), frozenset({1}), Opaque(), 1 + 0j],
    ids=["tuple", "frozenset", "object", "complex"],
)
def test_unsupported_dict_keys(job, key):
    with pytest.raises(ckpt.UnsupportedValue) as ei:
        ckpt.save({"outer": {key: torch.ones(1)}}, job, step=1)
    assert "outer" in str(ei.value)
    assert not os.path.exists(step_path(job, 1))


def test_reference_cycle_is_refused(job):
    a: list[Any] = [torch.ones(1)]
    a.append({"back": a})
    with pytest.raises(ckpt.UnsupportedValue, match="cycle"):
        ckpt.save({"a": a}, job, step=1)


def test_a_module_class_instead_of_an_instance(job):
    with pytest.raises(ckpt.UnsupportedValue) as ei:
        ckpt.save({"model": {"cls": torch.nn.Linear}}, job, step=1)
    assert "model/cls" in str(ei.value)


class Holder:
    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def state_dict(self) -> dict[str, Any]:
        return {"payload": self.payload}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.payload = sd["payload"]


def test_unsupported_value_inside_a_stateful_names_the_path(job):
    with pytest.raises(ckpt.UnsupportedValue) as ei:
        ckpt.save({"trainer": Holder({"cb": Opaque()})}, job, step=1)
    assert "trainer/payload/cb" in str(ei.value)


def test_metadata_must_be_plain_json(job):
    with pytest.raises(ckpt.UnsupportedValue):
        ckpt.save({"w": torch.ones(1)}, job, step=1, metadata={"t": torch.ones(1)})
    with pytest.raises(ckpt.UnsupportedValue):
        ckpt.save({"w": torch.ones(1)}, job, step=1, metadata={"x": float("nan")})
    with pytest.raises(ckpt.UnsupportedValue):
        ckpt.save({"w": torch.ones(1)}, job, step=1, metadata=["not", "a", "dict"])
    assert not os.path.isdir(job) or list_files(job) == []


def test_nothing_on_storage_is_pickle(job):
    """Every file a save writes is JSON or raw tensor bytes."""
    ckpt.save({"w": torch.ones(4), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}, job, step=1)
    for rel in list_files(job):
        data = Path(job, rel).read_bytes()
        if rel.endswith(".json"):
            import json

            json.loads(data)
        elif rel == ".ckptd/catalog.sqlite.lock":  # its lock names the holder, in text
            assert data.decode().startswith("pid "), data
        elif rel.startswith(".ckptd/catalog.sqlite"):  # the embedded coordinator's catalog
            assert rel == ".ckptd/catalog.sqlite" and data.startswith(b"SQLite format 3\0"), rel
        else:
            assert rel.endswith(".bin"), rel
            assert not data.startswith(b"\x80"), "pickle protocol header in a shard"
