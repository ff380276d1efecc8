"""The nvidia plugin's allocators: device memory through torch's CUDA caching allocator
(the KV arena is one allocation), pinned host memory for staging, sleep mode; the
mechanics are `tokenmill_triton.memory`'s, the limits are chosen here.

Limits, fixed when an allocator is made (at activation): KV arena
`$TOKENMILL_NVIDIA_KVCACHE_GIB` GiB, else 90% of the device memory free at that moment;
weights the device's total memory; host staging 10% of available host memory. In
interpreter mode everything is host memory: 40% / 90% / 10% of what is available.
"""

from __future__ import annotations

from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill_triton.memory import DeviceAllocator, make_device_allocator

KVCACHE_ENV = "TOKENMILL_NVIDIA_KVCACHE_GIB"
GPU_FRACTIONS = {AllocatorPurpose.KV_ARENA: 0.9, AllocatorPurpose.WEIGHTS: 1.0}
HOST_FRACTIONS = {
    AllocatorPurpose.KV_ARENA: 0.4,
    AllocatorPurpose.WEIGHTS: 0.9,
    AllocatorPurpose.HOST_STAGING: 0.1,
}


def make_allocator(purpose: AllocatorPurpose, interpreter: bool) -> DeviceAllocator:
    return make_device_allocator(purpose, interpreter, "nvidia", KVCACHE_ENV, GPU_FRACTIONS,
                                 HOST_FRACTIONS)
