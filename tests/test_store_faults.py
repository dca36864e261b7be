# ruff: noqa: F811 - pytest fixtures imported from s3_server are used as parameters
"""Faults between the client and the store: a fault proxy in front of the moto server.

Every save either commits whole or aborts with an error naming the rank, the object and
the cause within its time bound (ckptd.storage.retry), and the checkpoint before it
always loads; an aborted save leaves no multipart upload behind. Throttling (`SlowDown`),
503s, connections reset mid-body, stalls without a byte and answers lost after the
store acted are each tried on the parts of a shard, the manifest PUT and the ranged GETs
of a load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import torch
from fault_proxy import FaultProxy
from s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures

import ckpt
from ckptd import knobs
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import open_storage
from ckptd.storage import retry as store_retry

PART = 5 << 20
# Short bounds so that a fault that never clears ends a save in seconds, not minutes.
BOUNDS = dict(
    store_request_timeout_s=3.0,
    store_attempts=3,
    store_backoff_s=0.05,
    store_backoff_max_s=0.2,
    upload_part_size=PART,
    upload_concurrency=2,
    store_get_size=1 << 20,
)


@pytest.fixture
def proxy(s3_server, monkeypatch) -> Iterator[FaultProxy]:
    s3fs = pytest.importorskip("s3fs")
    up = urlsplit(s3_server.endpoint)
    p = FaultProxy(str(up.hostname), int(up.port or 80)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client still has moto's address
    try:
        with knobs.override(**BOUNDS):
            yield p
    finally:
        p.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn((4 * PART) // 4, generator=g), "b": torch.arange(10) + seed}


def save_bounded(state, url: str, step: int) -> tuple[BaseException | None, float]:
    """ckpt.save in a thread; (its error, seconds). A save that hangs fails the test."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            ckpt.save(state, url, step=step)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[0] = e

    bound = 4 * store_retry.policy().bound_s + 120  # the parts', the commit's, slack
    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"the save of step {step} did not end within {bound:.0f} s"
    return out[0], time.monotonic() - t0


def committed(url: str) -> list[int]:
    return [s.step for s in ckfmt.list_steps(open_storage(url)) if s.status == ckfmt.COMMITTED]


def assert_loads(url: str, step: int) -> None:
    lr = ckpt.load({}, url, step=step)
    want = big_state(step)
    assert torch.equal(lr.state["w"], want["w"]) and torch.equal(lr.state["b"], want["b"])


@pytest.mark.parametrize("fault", ["slowdown", "503", "reset", "stall", "lost"])
def test_a_passing_fault_on_parts_still_commits_whole(proxy, s3_bucket, fault, tally):
    url = f"s3://{s3_bucket}/job"
    ckpt.save(big_state(1), url, step=1)
    rule = proxy.inject("upload_part", fault, times=2)
    with tally.fault(f"object store: {fault} on 2 parts of a shard"):
        err, _ = save_bounded(big_state(2), url, 2)
        assert err is None, err
    assert rule.hits == 2
    assert committed(url) == [1, 2]
    assert_loads(url, 2)
    assert open_storage(url).pending_uploads() == []


@pytest.mark.parametrize("fault", ["slowdown", "503", "reset", "stall"])
def test_a_part_that_keeps_failing_aborts_the_save_naming_rank_object_cause(
    proxy, s3_bucket, fault, tally
):
    url = f"s3://{s3_bucket}/job"
    ckpt.save(big_state(1), url, step=1)
    proxy.inject("upload_part", fault, times=-1)
    with tally.fault(f"object store: {fault} on every part of a shard"):
        err, _ = save_bounded(big_state(2), url, 2)
        assert isinstance(err, CkptError), err
    msg = str(err)
    assert "rank 0" in msg and "rank-00000" in msg and layout.step_dir(2) in msg, msg
    cause = {
        "slowdown": "SlowDown",
        "503": "ServiceUnavailable",
        "reset": "Connection",  # reset by peer / disconnected, in the library's words
        "stall": "no answer within 3 s",
    }[fault]
    assert cause.lower() in msg.lower(), msg
    proxy.clear()
    proxy.release_stalls()
    assert committed(url) == [1]
    assert_loads(url, 1)
    assert open_storage(url).pending_uploads() == []  # aborted, not left to bill


@pytest.mark.parametrize("fault", ["slowdown", "reset", "stall", "lost"])
def test_manifest_put_faults(proxy, s3_bucket, fault, tally):
    # "lost": the manifest landed but its answer did not; the retry finds its own bytes
    # (If-None-Match refuses it) and must call that a commit, not another writer's.
    url = f"s3://{s3_bucket}/job"
    rule = proxy.inject("put", fault, times=1, key=layout.MANIFEST_NAME)
    with tally.fault(f"object store: {fault} on the manifest PUT"):
        err, _ = save_bounded(big_state(1), url, 1)
        assert err is None, err
    assert rule.hits == 1
    assert committed(url) == [1]
    assert_loads(url, 1)


@pytest.mark.parametrize("fault", ["slowdown", "503", "reset", "stall"])
def test_ranged_get_faults_during_a_load(proxy, s3_bucket, fault, tally):
    url = f"s3://{s3_bucket}/job"
    ckpt.save(big_state(1), url, step=1)
    rule = proxy.inject("get", fault, times=3)
    with tally.fault(f"object store: {fault} on 3 ranged GETs of a load"):
        assert_loads(url, 1)
    assert rule.hits == 3


@pytest.mark.multiprocess
def test_one_ranks_failing_upload_aborts_the_save_for_every_rank(
    proxy, s3_bucket, tmp_path, monkeypatch, tally
):
    # marin#9213: a SlowDown on one rank stranded the others at a barrier. Here rank 1's
    # parts keep failing; rank 0 hears of it from the coordinator and both go on.
    import json
    import multiprocessing as mp

    from coordinator_fixtures import free_port
    from ranks import store_fault_worker

    for k, v in BOUNDS.items():
        monkeypatch.setenv(f"CKPT_{k.upper()}", str(v))
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "catalogs"))
    url = f"s3://{s3_bucket}/job"
    proxy.inject("upload_part", "slowdown", times=-1, key=f"{layout.step_dir(2)}/shards/rank-00001")
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=store_fault_worker.spawn_entry, args=(r, 2, port, url, str(out)))
        for r in range(2)
    ]
    with tally.fault("object store: SlowDown on every part of one rank's shard (2 ranks)"):
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        logs = "\n".join(
            f"--- rank {r}\n{(out / f'rank{r}.log').read_text(errors='replace')[-3000:]}"
            for r in range(2)
        )
        assert not hung, f"ranks hung:\n{logs}"
        res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert all(r.get("error") is None for r in res), logs
    r0, r1 = res
    assert r1["step2"].startswith("StorageError") and "rank 1" in r1["step2"], r1
    assert "rank-00001" in r1["step2"] and "SlowDown" in r1["step2"], r1
    # Rank 0 wrote its shard; the coordinator's abort names rank 1 and its cause.
    assert r0["step2"].startswith("SaveAborted") and "rank 1" in r0["step2"], r0
    assert "SlowDown" in r0["step2"], r0
    assert [(r["resumed"], r["exact"]) for r in res] == [(1, True), (1, True)]
    assert committed(url) == [1]
    assert open_storage(url).pending_uploads() == []


@pytest.mark.parametrize("fault", ["503", "stall"])
def test_a_step_whose_gets_keep_failing_falls_back_to_the_one_before(
    proxy, s3_bucket, fault, tally
):
    # An unreadable copy is skipped, not quarantined (the fault may pass): the load takes
    # the step before it, within the GETs' bound, and step 2 is still there afterwards.
    url = f"s3://{s3_bucket}/job"
    ckpt.save(big_state(1), url, step=1)
    ckpt.save(big_state(2), url, step=2)
    proxy.inject("get", fault, times=-1, key=f"{layout.step_dir(2)}/shards/")
    with tally.fault(f"object store: {fault} on every ranged GET of the newest step"):
        lr = ckpt.load({}, url)
    assert lr.step == 1
    assert torch.equal(lr.state["w"], big_state(1)["w"])
    proxy.clear()
    proxy.release_stalls()
    assert committed(url) == [1, 2]
    assert_loads(url, 2)
