"""Format v1: layout, manifest and shard index, block hashing, shard writer and reader."""
