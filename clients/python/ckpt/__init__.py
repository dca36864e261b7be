"""ckpt: verified checkpoints for training loops.

import ckpt
ckpt.save(state, "/ckpts/run42", step=100)
ckpt.load(state, "/ckpts/run42")          # newest committed step, in place

ckpt.init("/ckpts/run42")                 # or CKPT_PATH: a process-wide Checkpointer
start = ckpt.resume(state) or 0           # newest whole checkpoint; None for a new job
ckpt.save(state)                          # asynchronous; step from state["step"]
ckpt.wait()
"""

from ckpt._api import apply_retention, load, save
from ckpt._checkpointer import Checkpointer
from ckpt._default import init, resume, wait
from ckpt._flatten import PerRank
from ckpt._memory import MemoryTier
from ckpt._pending import PendingSave
from ckpt._restore import LoadResult
from ckpt._results import SaveResult
from ckpt._rng import RNGState
from ckptd.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    DivergentReplicas,
    HashMismatch,
    InvalidManifest,
    JobInUse,
    MemoryBudgetExceeded,
    NonFiniteCheckpoint,
    PeerReadFailed,
    SaveAborted,
    SaveFailed,
    ShardMissing,
    ShardSizeMismatch,
    StaleGeneration,
    StateMismatch,
    StepMismatch,
    StorageError,
    Unauthenticated,
    UnsafePath,
    UnsupportedValue,
)

__all__ = [
    "Checkpointer",
    "CoordinatorUnavailable",
    "DivergentReplicas",
    "PendingSave",
    "PerRank",
    "RNGState",
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
    "PeerReadFailed",
    "JobInUse",
    "MemoryBudgetExceeded",
    "MemoryTier",
    "NonFiniteCheckpoint",
    "LoadResult",
    "SaveResult",
    "ShardMissing",
    "ShardSizeMismatch",
    "StateMismatch",
    "StepMismatch",
    "StorageError",
    "UnsafePath",
    "UnsupportedValue",
    "apply_retention",
    "init",
    "load",
    "resume",
    "save",
    "wait",
]
