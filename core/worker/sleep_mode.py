"""Sleep mode, as vLLM's: free an idle engine's device memory and get it back later.

- level 1: the weights go to host memory, the KV cache is discarded;
- level 2: both are discarded; on wake the weights are read again from the checkpoint
  (for a process that will receive new weights, RLHF style, or to free host memory too).

The core holds no device API: it only calls the platform's allocators (`Allocator.sleep` /
`wake`, offered where the platform declares `capabilities.sleep_mode`). For the weights to
be the allocator's to free, a model built for a sleep-capable platform has every
parameter moved into a buffer of the platform's WEIGHTS allocator right after loading
(`adopt_weights`, one buffer per parameter, so the load's peak grows by the largest
parameter only). Buffers that are not parameters (rotary tables) stay where they are:
they are small and not in the checkpoint.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.platforms.interfaces import Allocator

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


def check_level(level: object) -> int:
    """`level` if it is a sleep level, else ValueError naming it."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level {level!r} is not one of {SLEEP_LEVELS} (1: weights to "
                         "host memory, KV discarded; 2: both discarded)")
    return int(level)


@torch.no_grad()
def adopt_weights(model: nn.Module, allocator: Allocator) -> list[torch.Tensor]:
    """Move every parameter's data into its own buffer from `allocator` (same dtype, shape
    and values; the Parameter objects stay, so modules and optimisers keep theirs).
    Call after loading and before anything keeps a reference to a parameter's old tensor
    (the platform's `prepack_linear`). Returns the buffers: `release_weights` gives them
    back when the model goes (the allocator keeps its live buffers alive until then)."""
    buffers = []
    total = 0
    for param in {id(p): p for p in model.parameters()}.values():  # tied ones once
        num_bytes = param.numel() * param.element_size()
        if num_bytes == 0:
            continue
        buffer = allocator.allocate(num_bytes)
        view = buffer.view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        buffers.append(buffer)
        total += num_bytes
    logger.info("sleep mode: %.2f GiB of weights in the platform's weights allocator",
                total / (1 << 30))
    return buffers


def release_weights(buffers: list[torch.Tensor], allocator: Allocator) -> None:
    """Free the buffers `adopt_weights` returned (the model must not be used after)."""
    for buffer in buffers:
        allocator.free(buffer)
    buffers.clear()
