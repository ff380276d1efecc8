"""Padding buckets: the static shapes a jitted step is compiled for.

Every dynamic size of a step (tokens, sequences, query tiles, pages per sequence) is
rounded up to a power of two at or above a floor, so a run compiles O(log n) shapes per
size instead of one per step; once a run has seen its largest step, nothing recompiles.
"""

from __future__ import annotations


def bucket(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, floor)."""
    size = max(int(floor), 1)
    while size < n:
        size *= 2
    return size
