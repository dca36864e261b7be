"""The public face of `ckpt` is exactly its `__all__` (httpx's test, adapted)."""

from __future__ import annotations

import types

import ckpt
from ckptd import errors


def test_all_matches_public_names():
    public = {
        name
        for name in dir(ckpt)
        if not name.startswith("_") and not isinstance(getattr(ckpt, name), types.ModuleType)
    }
    assert sorted(ckpt.__all__) == sorted(public)


def test_all_has_no_duplicates_and_everything_resolves():
    assert len(ckpt.__all__) == len(set(ckpt.__all__))
    for name in ckpt.__all__:
        assert getattr(ckpt, name) is not None, name


def test_exported_errors_are_ckptd_errors():
    for name in ckpt.__all__:
        obj = getattr(ckpt, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert getattr(errors, name) is obj, name
            assert issubclass(obj, errors.CkptError), name


def test_the_errors_save_and_load_raise_are_exported():
    """A training loop catches these from `ckpt` without importing ckptd."""
    for name in (
        "CkptError",
        "CheckpointNotFound",
        "CheckpointExists",
        "CorruptCheckpoint",
        "ShardMissing",
        "ShardSizeMismatch",
        "HashMismatch",
        "InvalidManifest",
        "UnsafePath",
        "UnsupportedValue",
        "StateMismatch",
        "StorageError",
    ):
        assert name in ckpt.__all__, name


# Subpackages that are public by design (imported explicitly, never by `import ckpt`).
PUBLIC_SUBPACKAGES = {"integrations"}


def test_private_modules_stay_private():
    modules = {n for n in dir(ckpt) if isinstance(getattr(ckpt, n), types.ModuleType)}
    assert all(n.startswith("_") or n in PUBLIC_SUBPACKAGES for n in modules), modules
