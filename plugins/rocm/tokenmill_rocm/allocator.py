"""The rocm plugin's allocator setting: `$TOKENMILL_ROCM_KVCACHE_GIB` fixes its KV arena.

Device memory comes from torch's caching allocator (HIP behind torch.cuda), else as the
nvidia plugin's: `tokenmill_triton.memory` has the mechanics and sleep mode,
`tokenmill_triton.platform_kit` the limits shared by both GPU plugins.
"""

KVCACHE_ENV = "TOKENMILL_ROCM_KVCACHE_GIB"
