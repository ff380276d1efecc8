"""Content keys for prefix caching.

A full block's key chains its parent's key, the block's token ids and tagged extra keys
(cache salt, adapter, model fingerprint) through SHA-256, so two blocks share a key only
when everything before and inside them is the same.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"tokenmill-kv-root"


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[tuple[str, str], ...] = (),
) -> BlockHash:
    """The key of one full block. `extra_keys` is a tuple of (tag, value) pairs."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(json.dumps(extra_keys, separators=(",", ":")).encode())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[tuple[str, str], ...] = (),
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of the full blocks of `token_ids` from block index `start` on.

    `parent` must be the key of block `start - 1` (None when start is 0). Only the first
    block of a chain carries the extra keys; the chain carries them onwards.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        extra = extra_keys if i == 0 else ()
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
