"""The per-node memory agent: holds recent checkpoints in shared memory, outliving ranks.

`ckptd agent` (ckptd.cli.agent) runs one per node; the node's first rank starts it when
none runs (ckpt._memory). Its shared-memory directory is a job directory of its own
(format v2 step directories), so the load policy reads it like any other tier.
"""
