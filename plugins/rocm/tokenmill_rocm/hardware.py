"""The device's `HardwareSpec`: name, CU count and memory read from the device; peak FLOP/s
and bandwidth from AMD's datasheets (OAM parts).

Peaks are dense (no sparsity) matrix-core figures for bf16/fp16 and tf32 (CDNA4 has no
tf32: its fp32 rate is given) and the vector fp32 rate; link is Infinity Fabric per
direction to all 7 peers; memory the datasheet's HBM capacity (MI300X: 192 GB HBM3 at
5.3 TB/s, AMD Instinct MI300X data sheet). An unknown part is estimated from its CU count
(`$TOKENMILL_ROCM_PEAK_TFLOPS_BF16` / `$TOKENMILL_ROCM_MEMORY_BANDWIDTH_GBS` override).
"""

from __future__ import annotations

from tokenmill.platforms.interfaces import HardwareSpec
from tokenmill_triton.specs import GIB, Part, T, spec_from_table, table_spec

ENV_PREFIX = "TOKENMILL_ROCM"
PARTS = (
    Part("MI355X", 2516.6 * T, 157.3 * T, 157.3 * T, 8.0e12, 537.6e9, 288 * GIB),
    Part("MI350X", 2306.9 * T, 144.2 * T, 144.2 * T, 8.0e12, 537.6e9, 288 * GIB),
    Part("MI325X", 1307.4 * T, 653.7 * T, 163.4 * T, 6.0e12, 448e9, 256 * GIB),
    Part("MI300X", 1307.4 * T, 653.7 * T, 163.4 * T, 5.3e12, 448e9, 192 * GIB),
)
_NOMINAL_CLOCK_HZ = 2.1e9


def spec_for(name: str, cu_count: int, memory_bytes: int, gcn_arch: str) -> HardwareSpec:
    """The spec of a device with these properties (a pure function, tested on CPU)."""
    per_cu = 4096 if gcn_arch.startswith("gfx95") else 2048  # dense bf16 FLOP per CU per clock
    label = f"{name} ({cu_count} CUs, {gcn_arch.split(':')[0] or 'unknown gfx'})"
    return spec_from_table(PARTS, name, label, memory_bytes, cu_count * per_cu * _NOMINAL_CLOCK_HZ,
                           ENV_PREFIX)


def named_spec(device: str) -> HardwareSpec | None:
    """The datasheet spec of the part named `device` ("MI300X"), for the planner; None
    when the table has no such part."""
    return table_spec(PARTS, device, "AMD")


def device_spec(index: int = 0) -> HardwareSpec:
    """The spec of HIP device `index` (initialises HIP: call from activation only)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return spec_for(props.name, props.multi_processor_count, props.total_memory,
                    getattr(props, "gcnArchName", ""))
