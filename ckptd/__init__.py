"""ckptd: verified, high-throughput checkpoint storage for distributed training."""

__version__ = "0.1.0"
