"""Every error ckptd raises, one tree.

    CkptError
    ├── CheckpointNotFound(FileNotFoundError)   no committed checkpoint / no such step
    ├── CheckpointExists(FileExistsError)       the step is already committed
    ├── CorruptCheckpoint                       storage disagrees with what was committed
    │   ├── ShardMissing(FileNotFoundError)
    │   ├── ShardSizeMismatch
    │   ├── HashMismatch
    │   └── InvalidManifest(ValueError)         manifest or shard index unreadable / unsafe
    ├── UnsafePath(PermissionError)             a path escapes the checkpoint directory
    ├── UnsupportedValue(TypeError)             a state value ckptd refuses to store
    ├── StateMismatch(KeyError)                 load target and checkpoint disagree
    ├── StorageError(OSError)                   an I/O call failed while saving or loading
    ├── InvalidRequest(ValueError)              a malformed request to the coordinator
    ├── Unauthenticated(PermissionError)        wrong or missing coordinator token
    ├── MemoryBudgetExceeded                    a memory agent's budget refused a shard
    ├── CoordinatorUnavailable(ConnectionError) the coordinator cannot be reached
    ├── JobInUse                                another process's coordinator has the job open
    ├── MirrorIncomplete                        a rank's copy never reached the mirror
    ├── NonFiniteCheckpoint                     a load with require_finite met NaN or Inf
    └── SaveFailed                              a save did not commit
        ├── SaveAborted                         aborted: a rank failed, lease expired, timeout
        ├── StaleGeneration                     fenced: a newer generation of the job exists
        ├── DivergentReplicas                   ranks hold different values under one key
        └── StepMismatch                        ranks save different steps at once

Messages name the job path, step, rank, shard file and key involved, and say what to do.
Translate foreign exceptions only at boundaries (storage calls, JSON parsing).
"""

from __future__ import annotations


class CkptError(Exception):
    """Root of every ckptd error."""


class CheckpointNotFound(CkptError, FileNotFoundError):
    pass


class CheckpointExists(CkptError, FileExistsError):
    pass


class CorruptCheckpoint(CkptError):
    """The bytes in storage are not what the manifest committed."""


class ShardMissing(CorruptCheckpoint, FileNotFoundError):
    pass


class ShardSizeMismatch(CorruptCheckpoint):
    pass


class HashMismatch(CorruptCheckpoint):
    pass


class InvalidManifest(CorruptCheckpoint, ValueError):
    pass


class PeerReadFailed(CorruptCheckpoint):
    """Another rank, reading this copy for the whole job, found it corrupt or unreadable."""


class UnsafePath(CkptError, PermissionError):
    pass


class UnsupportedValue(CkptError, TypeError):
    pass


class StateMismatch(CkptError, KeyError):
    # KeyError's str() quotes its argument; keep messages readable.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageError(CkptError, OSError):
    pass


class InvalidRequest(CkptError, ValueError):
    pass


class LayoutUnknown(CkptError):
    """A cached plan named a layout (by digest) that the coordinator does not hold: it
    restarted or evicted it. Not a failure of the save: the client sends the whole plan
    (ckptd.coordinator.layouts)."""


class Unauthenticated(CkptError, PermissionError):
    pass


class MemoryBudgetExceeded(CkptError):
    """A memory agent refused a shard that does not fit its budget (max steps / bytes)."""


class CoordinatorUnavailable(CkptError, ConnectionError):
    pass


class JobInUse(CkptError):
    """Another process hosts a coordinator over the same catalog (a job open twice)."""


class MirrorIncomplete(CkptError):
    """A rank's verified copy of its shard never reached the mirror: the step is not
    committed there (ckptd.format.mirror.commit_copy)."""


class NonFiniteCheckpoint(CkptError):
    """A whole step whose health stats count NaN or Inf values in a tensor the load asked
    for, refused because the load passed require_finite (ckpt._load). Not damage: nothing
    is quarantined, and a load by explicit step without require_finite still reads it."""


class SaveFailed(CkptError):
    """A save did not commit; earlier checkpoints are untouched."""


class SaveAborted(SaveFailed):
    pass


class StaleGeneration(SaveFailed):
    pass


class DivergentReplicas(SaveFailed):
    pass


class StepMismatch(SaveFailed):
    """Ranks of one job save different steps at once (or one skipped a save the others
    make): none of those saves can gather every rank, so all of them are aborted."""


__all__ = [
    "CkptError",
    "CheckpointNotFound",
    "CheckpointExists",
    "CorruptCheckpoint",
    "ShardMissing",
    "ShardSizeMismatch",
    "HashMismatch",
    "InvalidManifest",
    "PeerReadFailed",
    "UnsafePath",
    "UnsupportedValue",
    "StateMismatch",
    "StorageError",
    "InvalidRequest",
    "LayoutUnknown",
    "Unauthenticated",
    "MemoryBudgetExceeded",
    "CoordinatorUnavailable",
    "JobInUse",
    "MirrorIncomplete",
    "NonFiniteCheckpoint",
    "SaveFailed",
    "SaveAborted",
    "StaleGeneration",
    "DivergentReplicas",
    "StepMismatch",
]
