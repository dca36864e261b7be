"""`ckptctl restore`: consolidated exports read back by their own libraries, bit for bit.

The checkpoint is written as two ranks' shards (every tensor split on dim 0, unevenly),
plus small whole tensors, in the dtypes a training state holds (bf16, float8, bool, ints,
0-d and empty tensors). safetensors output is read with safetensors.torch.load_file, torch
output with torch.load(weights_only=True), zarr output with zarr-python (and tensorstore
for --zarr-keep-bfloat16).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_testutil import flip_bit, tensor_raw

from ckptd import knobs
from ckptd.export import zarr as zarr_export
from ckptd.format import checkpoint as ckfmt
from ckptd.format.manifest import Manifest
from ckptd.format.writer import WriteItem, write_shard
from ckptd.storage import open_storage

zarr = pytest.importorskip("zarr")
safetensors_torch = pytest.importorskip("safetensors.torch")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "model/layers.0.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
        "model/layers.0.bias": torch.randn(37, generator=g),
        "model/emb": torch.randint(-1000, 1000, (9, 4), generator=g),
        "model/scale": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
        "optim/state/0/exp_avg": torch.randn(37, 16, generator=g, dtype=torch.float64),
        "mask": torch.rand(11, generator=g) > 0.5,
        "half": torch.randn(6, 2, generator=g).to(torch.float16),
        "count": torch.tensor(41, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
        "bytes": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "mine/@rank1": torch.arange(4, dtype=torch.int16),
    }


def raw(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(tensor_raw(t), dtype=np.uint8)


def write_two_ranks(root: Path, state: dict[str, torch.Tensor], block: int = 4096) -> None:
    """Every tensor of 2+ rows is split on dim 0 over two shards (uneven), others on rank 0."""
    from ckptd.format import dtypes

    storage = open_storage(str(root), create=True)
    items: list[list[WriteItem]] = [[], []]
    for key, t in state.items():
        name = dtypes.name_of(t.dtype)
        if t.dim() and t.shape[0] >= 2:
            cut = t.shape[0] // 3 + 1
            for r, (a, b) in enumerate(((0, cut), (cut, t.shape[0]))):
                part = t[a:b].contiguous()
                items[r].append(
                    WriteItem(
                        key,
                        name,
                        list(t.shape),
                        [a] + [0] * (t.dim() - 1),
                        list(part.shape),
                        raw(part).copy(),
                    )
                )
        else:
            items[0].append(
                WriteItem(key, name, list(t.shape), [0] * t.dim(), list(t.shape), raw(t).copy())
            )
    with knobs.override(block_size=block):
        ckfmt.begin_step(storage, 7)
        shards = [
            write_shard(
                storage, job=str(root), step=7, rank=r, world_size=2, generation=0, items=items[r]
            )
            for r in range(2)
        ]
        state_node = {"dict": [[k, {"tensor": k}] for k in state]}
        m = Manifest(
            job=str(root),
            step=7,
            generation=0,
            world_size=2,
            block_size=block,
            alignment=4096,
            shards=shards,
            state=state_node,
            metadata={"note": "two ranks"},
        )
        ckfmt.commit(storage, m)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    state = tensors()
    job = tmp_path / "job"
    write_two_ranks(job, state)
    return str(job), state


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_raw(a) == tensor_raw(b)


def test_safetensors(saved, tmp_path, ckptctl):
    job, state = saved
    out = tmp_path / "model.safetensors"
    rc, o, e = ckptctl("restore", job, "--to", out, "--format", "safetensors")
    assert rc == 0, e
    assert "restored step 7" in o
    got = safetensors_torch.load_file(str(out))
    assert set(got) == set(state)
    assert all(same(got[k], state[k]) for k in state), [
        k for k in state if not same(got[k], state[k])
    ]
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["ckptd"])["step"] == 7


def test_torch(saved, tmp_path, ckptctl):
    job, state = saved
    out = tmp_path / "model.pt"
    rc, _, e = ckptctl("restore", job, "--to", out, "--format", "torch", "--json")
    assert rc == 0, e
    got = torch.load(out, weights_only=True)
    assert set(got) == set(state) and all(same(got[k], state[k]) for k in state)
    assert not list(tmp_path.glob("model.pt.*"))  # the scratch file is gone


def from_zarr(arr) -> torch.Tensor:
    from ckptd.format import dtypes

    dtype = dtypes.from_name(arr.attrs["ckptd"]["dtype"])
    data = np.ascontiguousarray(arr[...])
    if not data.size:
        return torch.empty(arr.shape, dtype=dtype)
    return torch.from_numpy(data.reshape(-1).view(np.uint8).copy()).view(dtype).reshape(arr.shape)


def test_zarr_read_with_zarr_python(saved, tmp_path, ckptctl):
    job, state = saved
    out = tmp_path / "model.zarr"
    rc, _, e = ckptctl("restore", job, "--to", out, "--format", "zarr")
    assert rc == 0, e
    root = zarr.open_group(str(out), mode="r")
    assert root.attrs["ckptd"]["step"] == 7 and root.attrs["ckptd"]["metadata"] == {
        "note": "two ranks"
    }
    arrays = {name: a for name, a in root.members(max_depth=None) if isinstance(a, zarr.Array)}
    assert set(arrays) == set(state)
    for key, arr in arrays.items():
        assert arr.attrs["ckptd"]["key"] == key
        assert same(from_zarr(arr), state[key]), key
    bf = arrays["model/layers.0.weight"]
    assert bf.dtype == np.uint16 and bf.attrs["ckptd"]["encoding"] == "raw-bits"
    assert arrays["model/layers.0.bias"].attrs["ckptd"]["encoding"] == "native"


def test_zarr_keep_bfloat16_for_tensorstore(saved, tmp_path, ckptctl):
    ts = pytest.importorskip("tensorstore")
    job, state = saved
    out = tmp_path / "bf.zarr"
    rc, _, e = ckptctl(
        "restore", job, "--to", out, "--format", "zarr", "--keys", "model/layers.0.*",
        "--zarr-keep-bfloat16",
    )  # fmt: skip
    assert rc == 0, e
    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{out}/model/layers.0.weight"}).result()
    assert arr.dtype == ts.bfloat16
    data = arr.read().result()
    got = torch.from_numpy(data.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    assert same(got, state["model/layers.0.weight"])


def test_large_tensors_are_few_files(tmp_path, ckptctl, monkeypatch):
    monkeypatch.setattr(zarr_export, "INNER_CHUNK_BYTES", 4096)
    monkeypatch.setattr(zarr_export, "SHARD_BYTES", 64 << 10)
    big = {"w": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)}  # 256 KiB
    job = tmp_path / "job"
    write_two_ranks(job, big)
    out = tmp_path / "big.zarr"
    assert ckptctl("restore", job, "--to", out, "--format", "zarr")[0] == 0
    files = [p for p in (out / "w").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(files) == 4  # 64 inner chunks of 4 KiB in 4 shards of 64 KiB
    arr = zarr.open_array(str(out / "w"), mode="r")
    assert np.array_equal(arr[...], big["w"].numpy())


def test_chunking_bounds():
    outer, inner = zarr_export.chunking([4096, 8192], 4)  # 128 MiB
    assert np.prod(inner) * 4 <= 16 << 20 and outer == [4096, 8192]
    outer, inner = zarr_export.chunking([1 << 20, 4096], 2)  # 8 GiB: shards of <= 1 GiB
    assert np.prod(outer) * 2 <= 1 << 30 and all(
        o % i == 0 for o, i in zip(outer, inner, strict=True)
    )
    assert zarr_export.chunking([], 8) == ([], [])
    assert zarr_export.chunking([0, 5], 4) == ([1, 5], [1, 5])


def test_keys_select_and_unknown_pattern_fails(saved, tmp_path, ckptctl):
    job, state = saved
    out = tmp_path / "sel.safetensors"
    rc, _, e = ckptctl(
        "restore", job, "--to", out, "--format", "safetensors", "--keys", "model", "--keys", "mask"
    )
    assert rc == 0, e
    got = safetensors_torch.load_file(str(out))
    assert set(got) == {k for k in state if k.startswith("model/")} | {"mask"}
    rc, _, e = ckptctl(
        "restore", job, "--to", tmp_path / "x.pt", "--format", "torch", "--keys", "nope*"
    )
    assert rc == 1 and "'nope*'" in e
    assert not (tmp_path / "x.pt").exists()


def test_dtype_safetensors_lacks_is_refused_by_name(tmp_path, ckptctl):
    job = tmp_path / "job"
    write_two_ranks(job, {"z": torch.zeros(4, dtype=torch.complex32)})
    rc, _, e = ckptctl(
        "restore", job, "--to", tmp_path / "z.safetensors", "--format", "safetensors"
    )
    assert rc == 1 and "z (complex32)" in e and "--format torch" in e
    assert not list(tmp_path.glob("z.safetensors*"))
    assert ckptctl("restore", job, "--to", tmp_path / "z.pt", "--format", "torch")[0] == 0
    assert same(
        torch.load(tmp_path / "z.pt", weights_only=True)["z"], torch.zeros(4, dtype=torch.complex32)
    )


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "zarr"])
def test_corruption_fails_names_file_and_key_and_leaves_nothing(saved, tmp_path, ckptctl, fmt):
    job, _ = saved
    index = json.loads(Path(job, "step-000000000007", "shards", "rank-00001.json").read_text())
    [e] = [e for e in index["entries"] if e["key"] == "optim/state/0/exp_avg"]
    flip_bit(os.path.join(job, "step-000000000007", "shards", "rank-00001.bin"), e["offset"] + 9)
    out = tmp_path / f"out.{fmt}"
    rc, _, err = ckptctl("restore", job, "--to", out, "--format", fmt)
    assert rc == 1
    assert "rank-00001.bin" in err and "optim/state/0/exp_avg" in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.")]


def test_existing_output_needs_force(saved, tmp_path, ckptctl):
    job, _ = saved
    out = tmp_path / "m.pt"
    out.write_bytes(b"old")
    rc, _, e = ckptctl("restore", job, "--to", out, "--format", "torch")
    assert rc == 1 and "--force" in e and out.read_bytes() == b"old"
    assert ckptctl("restore", job, "--to", out, "--format", "torch", "--force")[0] == 0
    assert len(torch.load(out, weights_only=True)) == len(tensors())


def test_real_process(saved, tmp_path, run_ckptctl):
    job, state = saved
    out = tmp_path / "m.zarr"
    rc, o, e = run_ckptctl("restore", job, "--step", "7", "--to", out, "--format", "zarr", "--json")
    assert rc == 0, e
    doc = json.loads(o)
    assert doc["ok"] and doc["tensors"] == len(state) and doc["format"] == "zarr"
    assert doc["bytes_verified"] >= doc["bytes"]


ODD = {"": 1.0, ".": 2.0, "..": 3.0, "w": 4.0}  # key -> the value its tensor holds


def odd_keys_job(tmp_path: Path) -> str:
    """A job saved with ckpt.save whose keys the flatten escapes: "" and "." both want '.'."""
    import ckpt

    job = str(tmp_path / "odd")
    ckpt.save({k: torch.full((3,), v) for k, v in ODD.items()}, job, step=1)
    return job


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_keeps_the_users_keys(tmp_path, ckptctl, fmt):
    import ckpt

    job = odd_keys_job(tmp_path)
    out = tmp_path / f"odd.{fmt}"
    rc, o, e = ckptctl("restore", job, "--to", out, "--format", fmt, "--json")
    assert rc == 0, e
    assert sorted(json.loads(o)["keys"]) == sorted(ODD)
    got = (
        safetensors_torch.load_file(str(out))
        if fmt == "safetensors"
        else torch.load(out, weights_only=True)
    )
    assert set(got) == set(ODD)  # "" is "", "." is ".": nothing moved to '.#1'
    for k, v in ODD.items():
        assert torch.equal(got[k], torch.full((3,), v)), (k, got[k])
    # The checkpoint itself still round-trips them.
    back = ckpt.load({}, job).state
    assert {k: float(t[0]) for k, t in back.items()} == ODD
    # --keys matches the user's key ("." alone, not ".." nor "" stored as '.').
    sel = tmp_path / f"sel.{fmt}"
    assert ckptctl("restore", job, "--to", sel, "--format", fmt, "--keys", ".")[0] == 0
    got = (
        safetensors_torch.load_file(str(sel))
        if fmt == "safetensors"
        else torch.load(sel, weights_only=True)
    )
    assert list(got) == ["."] and float(got["."][0]) == 2.0


def test_zarr_export_of_odd_keys_keeps_them_in_the_attributes(tmp_path, ckptctl):
    job = odd_keys_job(tmp_path)
    out = tmp_path / "odd.zarr"
    rc, _, e = ckptctl("restore", job, "--to", out, "--format", "zarr")
    assert rc == 0, e
    root = zarr.open_group(str(out), mode="r")
    arrays = {n: a for n, a in root.members(max_depth=None) if isinstance(a, zarr.Array)}
    assert {a.attrs["ckptd"]["key"]: float(a[0]) for a in arrays.values()} == ODD


def test_export_refuses_keys_one_name_would_hold(tmp_path, ckptctl, tally):
    import ckpt

    job = str(tmp_path / "clash")
    ckpt.save(
        {"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}, "__metadata__": torch.ones(1)},
        job,
        step=1,
    )
    for fmt in ("safetensors", "torch"):
        out = tmp_path / f"clash.{fmt}"
        with tally.bad_input(f"export:{fmt}:two tensors one key"):
            rc, o, e = ckptctl(
                "restore", job, "--to", out, "--format", fmt, "--keys", "a", "--json"
            )
            assert rc == 1 and not out.exists()
            err = json.loads(o)["error"]
            assert "'a/b'" in err and "'a%2Fb'" in err and "--keys" in err, err
        # Each one alone, by its stored key, exports under the user's key.
        rc, _, e = ckptctl("restore", job, "--to", out, "--format", fmt, "--keys", "a%2Fb")
        assert rc == 0, e
    with tally.bad_input("export:safetensors:reserved key"):
        out = tmp_path / "meta.safetensors"
        rc, _, e = ckptctl("restore", job, "--to", out, "--format", "safetensors", "--keys", "_*")
        assert rc == 1 and "'__metadata__'" in e and "reserves" in e and not out.exists()
    out = tmp_path / "meta.pt"
    assert ckptctl("restore", job, "--to", out, "--format", "torch", "--keys", "_*")[0] == 0
    assert list(torch.load(out, weights_only=True)) == ["__metadata__"]


def test_zarr_without_the_export_extra_names_it(saved, tmp_path):
    """An installed ckptd without tensorstore: the real console script, in a process whose
    imports of tensorstore fail (a meta-path blocker installed by sitecustomize), says which
    extra to install and leaves no output behind."""
    from coordinator_fixtures import child_env, ckptctl_proc

    job, _ = saved
    blocker = tmp_path / "no_tensorstore"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorstore' or name.startswith('tensorstore.'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env["PYTHONPATH"]])
    out = tmp_path / "model.zarr"
    rc, o, e = ckptctl_proc("restore", job, "--to", out, "--format", "zarr", env=env)
    assert rc != 0, o
    assert "pip install 'ckptd[export]'" in e and "tensorstore" in e, e
    assert "Traceback" not in e, e
    assert not out.exists() and not list(tmp_path.glob("model.zarr*")), list(tmp_path.iterdir())
    # the blocker is what makes it fail: the same environment can still export safetensors
    rc, o, e = ckptctl_proc(
        "restore", job, "--to", tmp_path / "m.safetensors", "--format", "safetensors", env=env
    )
    assert rc == 0, e
