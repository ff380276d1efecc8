"""Collectives for CPU processes over torch.distributed's gloo backend, through the core's
`TorchDistributedCommunicator` (tokenmill.platforms.communicators).

Gloo notes (torch 2.4 - 2.14): `all_to_all_single` is native (gloo's alltoall, since
torch 1.7); gloo has no true reduce-scatter (its `reduce_scatter_tensor`, where present,
is an all-reduce followed by a slice), so `reduce_scatter` is an all-reduce of a copy and
a slice, on every torch version.
"""

from __future__ import annotations

import torch.distributed as dist

from tokenmill.platforms import communicators
from tokenmill.platforms.communicators import SingleProcessCommunicator
from tokenmill.platforms.interfaces import Communicator

__all__ = ["SingleProcessCommunicator", "make_communicator"]


def make_communicator(group: dist.ProcessGroup | None) -> Communicator:
    """Gloo collectives over `group`; a one-rank world when nothing is initialised."""
    return communicators.make_communicator(group, frozenset({"gloo"}), "cpu")
