"""How many bytes the KV cache gets when the user fixes neither its blocks nor its bytes.

vLLM's rule, on the platform's `memory_info`: the engine may use `memory_utilization` of
the device's total memory; what it already uses after loading the weights and running a
profiling step (the drop of free memory since the worker started; a caching allocator
keeps the step's peak reserved, so it shows) is not available to the KV cache. Memory
held by other processes is respected too: the cache never takes more than what is free
minus the share (1 - memory_utilization) of the total left for everyone else.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.platforms.interfaces import MemoryInfo

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVBudget:
    num_bytes: int  # what the KV cache may take (may be <= 0: nothing fits)
    explanation: str  # the figures it came from, for the log and for errors


def kv_cache_budget(start: MemoryInfo, now: MemoryInfo, memory_utilization: float) -> KVBudget:
    """`start`: memory_info when the worker started (before weights); `now`: after the
    weights and the profiling step."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization={memory_utilization} must be in (0, 1]")
    engine_bytes = max(0, start.free_bytes - now.free_bytes)
    usable = int(memory_utilization * now.total_bytes)
    allowed = usable - engine_bytes
    reserve = now.total_bytes - usable
    free_for_kv = now.free_bytes - reserve
    num_bytes = min(allowed, free_for_kv)
    explanation = (
        f"memory_utilization {memory_utilization} of {now.total_bytes / _GIB:.2f} GiB total, "
        f"the engine uses {engine_bytes / _GIB:.2f} GiB (weights + profiling step), "
        f"{now.free_bytes / _GIB:.2f} GiB free of which {reserve / _GIB:.2f} GiB stay for "
        f"others: {max(num_bytes, 0) / _GIB:.2f} GiB for the KV cache"
    )
    return KVBudget(num_bytes, explanation)
