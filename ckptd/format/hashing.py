"""blake3 over fixed-size blocks of each entry.

Blocks are relative to the start of an entry (not of the file), so an entry's hashes do
not depend on where it lands in a shard, and a partial read can verify the blocks it
covers. blake3 releases the GIL for large inputs, so per-block calls from a thread pool
hash on every core.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

import blake3

V = TypeVar("V")

HASH_NAME = "blake3"
HEX_LEN = 64


def digest(data: Any) -> str:
    return blake3.blake3(data).hexdigest()


def n_blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def block_bounds(length: int, block_size: int, i: int) -> tuple[int, int]:
    """[start, end) of block i of an entry of `length` bytes."""
    start = i * block_size
    return start, min(length, start + block_size)


def hash_blocks(data: memoryview, block_size: int) -> list[str]:
    return [digest(data[s : s + block_size]) for s in range(0, len(data), block_size)]


def chunk_digest(block_digests: list[str]) -> str:
    """One hash for a whole chunk, from its block hashes (no second pass over the bytes):
    the blake3 of their bytes one after another, in one call (a stream of one update per
    block hashes the same bytes, at a call per block)."""
    return blake3.blake3(bytes.fromhex("".join(block_digests))).hexdigest()


_HEX = re.compile(r"[0-9a-f]{64}")


def is_hex_digest(s: object) -> bool:
    """A lowercase 64-digit hex blake3 digest, exactly as hexdigest() writes it."""
    return isinstance(s, str) and _HEX.fullmatch(s) is not None


def all_hex_digests(seq: list[Any]) -> bool:
    """Whether every item is_hex_digest: each a str of 64 characters, and all of them
    together lowercase hex (an index holds a digest per block of every entry, thousands of
    them, parsed at every save's check and every load: two passes in C over them joined,
    not a match per digest). fromhex refuses any character but hex digits and whitespace,
    and each whitespace character would leave a byte fewer; lower() changes A-F."""
    try:
        if not set(map(len, seq)) <= {HEX_LEN}:
            return False
        run = "".join(seq)
        return len(bytes.fromhex(run)) * 2 == len(run) and run.lower() == run
    except (TypeError, ValueError):  # not a str (len, join), not hex (fromhex)
        return False


class DigestMemo(Generic[V]):
    """What was learned from some bytes (a verdict, a parse), remembered by their blake3.

    For a value that is a function of the bytes alone, a hit is exactly what working it out
    again would give, and any other bytes miss. Bounded (the least recently used goes
    first, so a miss only costs the work again); safe to share between threads. Values
    must be immutable: every hit hands out the same object."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._got: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            got = self._got.get(key)
            if got is not None:
                self._got.move_to_end(key)
            return got

    def put(self, key: str, value: V) -> None:
        with self._lock:
            self._got[key] = value
            self._got.move_to_end(key)
            while len(self._got) > self.limit:
                self._got.popitem(last=False)

    def __len__(self) -> int:
        return len(self._got)
