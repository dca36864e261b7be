"""The CUDA path: pinned staging on a side stream, CUDA tensors through Checkpointer.save,
ckpt.load (into CUDA tensors and into {}) and resume, and bench/gpu.py end to end. Marked
`gpu` (deselected by default; run with -m gpu on a machine with CUDA, or bench/gpu_check.sh);
without CUDA the benchmark exits with its "no CUDA device" message, and bench/gpu_check.sh
runs through to it, which the unmarked tests check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_testutil import flip_bit

import ckpt
from ckptd import knobs
from ckptd.errors import HashMismatch
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import open_storage

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_bench_without_cuda_exits_with_a_clear_message(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "no CUDA device" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing was written


def test_gpu_check_script_runs_the_tests_then_the_bench(tmp_path):
    """bench/gpu_check.sh, the one script for a lent GPU machine, runs ckptd from the source
    tree: here, without CUDA, its gpu tests skip and the bench says it measured nothing."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr  # the bench's "no CUDA device"
    assert "available: False" in out.stdout
    assert "gpu tests rc=0, bench/gpu.py rc=2" in out.stdout
    assert "skipped" in (tmp_path / "gpu-tests.log").read_text()
    assert "no CUDA device" in (tmp_path / "gpu-bench.log").read_text()


@pytest.mark.gpu
@needs_cuda
def test_cuda_state_saves_and_loads_through_pinned_staging(job):
    state = {
        "w": torch.randn(1 << 20, device="cuda"),
        "b": torch.randn(33, device="cuda", dtype=torch.bfloat16),
        "cpu": torch.arange(10),
    }
    with ckpt.Checkpointer(job, verify="full") as cp:
        cp.resume(state, allow_fresh_start=True)  # maps and registers the staging image
        pending = cp.save(state, 1)
        saved_w = state["w"].clone()  # (x + 1) - 1 != x in fp32: compare with a copy
        state["w"].add_(1)  # training goes on: the staged copy is what gets saved
        pending.wait()
        assert cp._image._pinned
        dst = {k: torch.zeros_like(v) for k, v in state.items()}
        assert cp.resume(dst) == 1
    assert dst["w"].device.type == "cuda"
    assert torch.equal(dst["w"], saved_w)
    assert torch.equal(dst["b"], state["b"]) and torch.equal(dst["cpu"], state["cpu"])
    out = ckpt.load({}, job, step=1).state  # a load into {} makes CPU tensors
    assert torch.equal(out["w"], saved_w.cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("ring", "slot"), [(128 << 20, 8 << 20), (3 * 4096, 4096), (0, 8 << 20)])
def test_cuda_load_streams_verified_blocks_and_refuses_a_corrupt_one(job, ring, slot):
    """Loads into CUDA tensors stream each verified block to the device (through the
    pinned ring, slots reused, or from pageable buffers): the targets hold the saved bytes;
    a corrupt block fails the load and never reaches the device."""
    g = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(3 << 18, generator=g),  # three 1 MiB hash blocks
        "bf16": torch.randn(1000, 33, generator=g).to(torch.bfloat16),
        "flags": torch.rand(5000, generator=g) > 0.5,
    }
    ckpt.save(state, job, step=1)
    # Queued on the default stream before the load: the copies must come after it.
    dst = {k: torch.empty_like(v, device="cuda").fill_(3) for k, v in state.items()}
    with knobs.override(device_load_ring=ring, device_load_slot=slot):
        ckpt.load(dst, job, step=1)
        for k, v in state.items():
            assert torch.equal(dst[k].cpu(), v), k
        ck = ckfmt.open_checkpoint(open_storage(job), 1)
        [chunk] = ck.chunks["big"]
        flip_bit(f"{job}/{ck.shard_path(chunk.shard)}", chunk.entry.offset + (1 << 20) + 7)
        dst["big"].fill_(5)
        with pytest.raises(HashMismatch, match=r"key 'big' block 1 "):
            ckpt.load(dst, job, step=1, fallback=False)
    got = dst["big"].view(3, 1 << 18).cpu()
    assert torch.equal(got[1], torch.full((1 << 18,), 5.0))


@pytest.mark.gpu
@needs_cuda
def test_gpu_bench_quick_run(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr  # 1: a goal missed, still a full run
    assert "Traceback" not in out.stderr, out.stderr
    assert "results:" in out.stdout
