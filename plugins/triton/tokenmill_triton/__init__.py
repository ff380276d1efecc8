"""Triton kernels shared by the tokenmill nvidia and rocm plugins.

Kernels live here once; each plugin passes its own launch settings (`configs.KernelConfigs`:
block sizes, num_warps, num_stages) and keeps its own collectives, allocator limits, hardware
table and probe. The plumbing those share is here too, parametrised by the plugin: the
torch.distributed communicator (distributed.py), the device allocator with sleep mode
(memory.py), the table lookup of hardware specs (specs.py), decode-step graphs
(graphs.py) and the plugins' hook bodies and capabilities (platform_kit.py). Importing this package imports nothing heavy; `triton` is imported by the
kernel modules.
"""

__version__ = "0.1.0"
