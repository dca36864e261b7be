"""ckpt: verified checkpoints for training loops.

import ckpt
ckpt.save(state, "/ckpts/run42", step=100)
ckpt.load(state, "/ckpts/run42")          # newest committed step, in place
"""

from ckpt._api import LoadResult, SaveResult, apply_retention, load, save
from ckptd.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    CorruptCheckpoint,
    HashMismatch,
    InvalidManifest,
    ShardMissing,
    ShardSizeMismatch,
    StateMismatch,
    StorageError,
    UnsafePath,
    UnsupportedValue,
)

__all__ = [
    "CheckpointExists",
    "CheckpointNotFound",
    "CkptError",
    "CorruptCheckpoint",
    "HashMismatch",
    "InvalidManifest",
    "LoadResult",
    "SaveResult",
    "ShardMissing",
    "ShardSizeMismatch",
    "StateMismatch",
    "StorageError",
    "UnsafePath",
    "UnsupportedValue",
    "apply_retention",
    "load",
    "save",
]
