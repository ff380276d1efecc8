"""Triton kernels shared by the tokenmill nvidia and rocm plugins.

Kernels live here once; each plugin passes its own launch settings (`configs.KernelConfigs`:
block sizes, num_warps, num_stages) and keeps its own collectives, allocator and probe.
Importing this package imports nothing heavy; `triton` is imported by the kernel modules.
"""

__version__ = "0.1.0"
