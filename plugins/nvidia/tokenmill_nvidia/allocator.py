"""The nvidia plugin's allocator setting: the variable that fixes its KV arena in GiB.

Device memory comes from torch's CUDA caching allocator (the KV arena is one allocation),
staging from pinned host memory, with sleep mode; mechanics in `tokenmill_triton.memory`,
limits (90% of free device memory for the KV arena unless `$TOKENMILL_NVIDIA_KVCACHE_GIB`
is set) in `tokenmill_triton.platform_kit`.
"""

KVCACHE_ENV = "TOKENMILL_NVIDIA_KVCACHE_GIB"
