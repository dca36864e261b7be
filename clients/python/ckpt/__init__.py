"""ckpt: verified checkpoints for training loops.

import ckpt
ckpt.save(state, "/ckpts/run42", step=100)
ckpt.load(state, "/ckpts/run42")          # newest committed step, in place
"""

from ckpt._api import LoadResult, SaveResult, apply_retention, load, save
from ckpt._checkpointer import Checkpointer
from ckpt._flatten import PerRank
from ckptd.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    DivergentReplicas,
    HashMismatch,
    InvalidManifest,
    SaveAborted,
    SaveFailed,
    ShardMissing,
    ShardSizeMismatch,
    StaleGeneration,
    StateMismatch,
    StorageError,
    Unauthenticated,
    UnsafePath,
    UnsupportedValue,
)

__all__ = [
    "Checkpointer",
    "CoordinatorUnavailable",
    "DivergentReplicas",
    "PerRank",
    "SaveAborted",
    "SaveFailed",
    "StaleGeneration",
    "Unauthenticated",
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
