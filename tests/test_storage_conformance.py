# ruff: noqa: F811 - pytest fixtures imported from the server modules are used as parameters
"""One conformance suite on every object store, each a real server the tests start:
S3 on moto, GCS on gcp-storage-emulator through gcsfs, Azure Blob on Azurite through adlfs
(tests/object_stores.py).

The Storage contract (storage/base.py), the manifest's create-only write refused by the
server itself (S3 If-None-Match: *, GCS ifGenerationMatch=0, Azure If-None-Match: *), a
shard streamed up while it is written and read back in parallel ranged GETs, and a save,
load and `ckptctl verify` through the public API.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from ckpt_testutil import assert_same
from object_stores import azure_connection, gcs_endpoint, object_store  # noqa: F401
from s3_server import s3_server  # noqa: F401 - fixture
from test_storage_fsspec import StorageContract, state_for

import ckpt
from ckptd import knobs
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import Storage, counters, open_storage


class TestObjectStoreContract(StorageContract):
    reuses, local = False, False

    @pytest.fixture
    def storage(self, object_store) -> Iterator[Storage]:
        yield open_storage(object_store.url())

    def test_remove_tree_and_rename(self, storage):
        # No empty directories: a prefix exists while an object lies under it.
        storage.write_atomic("t/u/f", b"1")
        storage.write_atomic("t/u/keep", b"2")
        storage.rename("t/u/f", "t/g")
        assert storage.listdir("t") == ["g", "u"]
        assert storage.read_bytes("t/g", limit=10) == b"1"
        storage.remove_tree("t")
        assert not storage.exists("t")

    def test_create_only_is_the_servers_check(self, storage, object_store):
        # The object appears between our (absent) check and the write: only the server's
        # conditional write can refuse it. Another client writes it directly.
        assert storage.atomic_create_only
        object_store.put_raw("job/r/MANIFEST.json", b"other")
        storage.exists = lambda path: False  # no client-side check can save us
        with pytest.raises(ckpt.CheckpointExists):
            storage.create_only("r/MANIFEST.json", b"mine")
        assert storage.read_bytes("r/MANIFEST.json", limit=100) == b"other"

    def test_a_shard_streams_up_and_reads_back_in_ranged_gets(self, storage):
        data = np.frombuffer(os.urandom(13 << 20), dtype=np.uint8)
        w = 1 << 20
        part = 5 << 20
        with knobs.override(
            upload_part_size=part, upload_concurrency=1, io_window=w, store_get_size=1 << 20
        ):
            h = storage.open_write("s/rank-0.bin", data.nbytes)
            for off in range(0, data.nbytes, w):
                h.write(off, min(w, data.nbytes - off), [(off, data[off : off + w])])
            # Streamed: a part in flight and one filling (S3), or nothing ahead of the
            # frontier (in-order files): never the whole shard.
            assert h.high_water <= 2 * part < data.nbytes
            h.finish()
            before = counters.snapshot()
            got = storage.open_read("s/rank-0.bin").read(1000, 9 << 20)
            delta = counters.snapshot() - before
        assert bytes(got) == data[1000 : 1000 + (9 << 20)].tobytes()
        assert delta.read_calls == 9 and delta.read_bytes == 9 << 20  # nine 1 MiB GETs
        assert storage.pending_uploads() == []

    def test_an_aborted_shard_leaves_no_object(self, storage):
        data = np.ones(12 << 20, dtype=np.uint8)
        with knobs.override(upload_part_size=5 << 20):
            h = storage.open_write("s/rank-1.bin", data.nbytes)
            h.write(0, 6 << 20, [(0, data[: 6 << 20])])
            h.abort()
        assert not storage.exists("s/rank-1.bin")
        assert storage.pending_uploads() == []


def test_save_load_verify_on_every_store(object_store, ckptctl):
    url = object_store.url()
    for s in (1, 2):
        ckpt.save(state_for(s), url, step=s)
    assert [s.step for s in ckfmt.list_steps(open_storage(url))] == [1, 2]
    rc, out, err = ckptctl("verify", url)
    assert rc == 0, out + err
    target = {"model": {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.bfloat16)}}
    lr = ckpt.load(target, url, strict=False)
    assert lr.step == 2
    assert_same(target["model"], state_for(2)["model"])
    keys = object_store.list_raw()
    assert f"job/{layout.step_dir(2)}/{layout.MANIFEST_NAME}" in keys


def test_checkpointer_on_every_store(object_store, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "catalogs"))
    url = object_store.url("runs/job")
    with ckpt.Checkpointer(url, keep_last=2) as cp:
        for s in (1, 2, 3):
            assert cp.save(state_for(s), s).wait() is not None
    assert [s.step for s in ckfmt.list_steps(open_storage(url))] == [2, 3]
    target = {"model": {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.bfloat16)}}
    with ckpt.Checkpointer(url) as cp:
        assert cp.resume(target, strict=False) == 3
    assert_same(target["model"], state_for(3)["model"])
