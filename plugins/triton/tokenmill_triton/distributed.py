"""Collectives over torch.distributed for the GPU plugins: NCCL (nvidia), RCCL (rocm; torch
names its backend "nccl" too), gloo in interpreter mode where tensors live on the CPU.

The communicator is the core's `TorchDistributedCommunicator`; NCCL is declared native, so
reduce-scatter and all-gather there are one call into one tensor.
"""

from __future__ import annotations

import torch.distributed as dist

from tokenmill.platforms import communicators
from tokenmill.platforms.interfaces import Communicator

_NATIVE_REDUCE_SCATTER = frozenset({"nccl"})


def make_communicator(
    group: dist.ProcessGroup | None, accepted_backends: frozenset[str], platform_name: str
) -> Communicator:
    return communicators.make_communicator(
        group, accepted_backends, platform_name, _NATIVE_REDUCE_SCATTER
    )
