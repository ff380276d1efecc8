"""The device's `HardwareSpec`: name, SM count and memory read from the device; peak FLOP/s
and bandwidth from NVIDIA's datasheets (SXM parts unless named).

Peaks are dense (no sparsity) tensor-core figures for bf16/fp16 and tf32, and the
non-tensor fp32 rate; link is NVLink per direction; memory the datasheet's capacity
(H200: 141 GB HBM3e at 4.8 TB/s, H200 datasheet; B200: 180 GB per GPU of an HGX / DGX
B200, whose datasheet gives 1,440 GB for 8 and 2.25 PFLOPS dense bf16 per GPU; NVLink 5
1.8 TB/s both ways per GPU). An unknown part is estimated from its
SM count (`tokenmill_triton.specs` marks it and names the override variables
`$TOKENMILL_NVIDIA_PEAK_TFLOPS_BF16` / `$TOKENMILL_NVIDIA_MEMORY_BANDWIDTH_GBS`).
"""

from __future__ import annotations

from tokenmill.platforms.interfaces import HardwareSpec
from tokenmill_triton.specs import GIB, Part, T, spec_from_table, table_spec

ENV_PREFIX = "TOKENMILL_NVIDIA"
# Longest match first: "H100 PCIe" before "H100".
PARTS = (
    Part("B200", 2250 * T, 1100 * T, 80 * T, 8.0e12, 900e9, 180 * GIB),
    Part("H200", 989.4 * T, 494.7 * T, 66.9 * T, 4.8e12, 450e9, 141 * GIB),
    Part("H100 PCIe", 756.5 * T, 378 * T, 51.2 * T, 2.0e12, 300e9, 80 * GIB),
    Part("H100 NVL", 835.5 * T, 417.5 * T, 60 * T, 3.9e12, 300e9, 94 * GIB),
    Part("H100", 989.4 * T, 494.7 * T, 66.9 * T, 3.35e12, 450e9, 80 * GIB),
    Part("A100", 312 * T, 156 * T, 19.5 * T, 2.039e12, 300e9, 80 * GIB),
)
# dense bf16 FLOP per SM per clock by compute capability major (Ampere, Hopper, Blackwell)
_FLOP_PER_SM_CLOCK = {8: 2048, 9: 4096, 10: 8192}
_NOMINAL_CLOCK_HZ = 1.5e9


def spec_for(name: str, sm_count: int, memory_bytes: int, capability_major: int) -> HardwareSpec:
    """The spec of a device with these properties (a pure function, tested on CPU)."""
    per_sm = _FLOP_PER_SM_CLOCK.get(min(capability_major, 10), 1024)
    return spec_from_table(PARTS, name, f"{name} ({sm_count} SMs)", memory_bytes,
                           sm_count * per_sm * _NOMINAL_CLOCK_HZ, ENV_PREFIX)


def named_spec(device: str) -> HardwareSpec | None:
    """The datasheet spec of the part named `device` ("H200", "B200"), for the planner;
    None when the table has no such part."""
    return table_spec(PARTS, device, "NVIDIA")


def device_spec(index: int = 0) -> HardwareSpec:
    """The spec of CUDA device `index` (initialises CUDA: call from activation only)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return spec_for(props.name, props.multi_processor_count, props.total_memory, props.major)
