"""Collectives for CPU processes over torch.distributed's gloo backend.

Gloo notes (torch 2.4 - 2.14): `all_to_all_single` is native (gloo's alltoall, since
torch 1.7); gloo has no true reduce-scatter (its `reduce_scatter_tensor`, where present,
is an all-reduce followed by a slice), so `reduce_scatter` is an all-reduce of a copy and
a slice here too, on every torch version. Ranks in the method arguments are ranks within
the communicator's group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.platforms.interfaces import Communicator


class GlooCommunicator(Communicator):
    """Every `Communicator` collective over one gloo process group (None: the world)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group('gloo', ...) before asking for a "
                "communicator over a group"
            )
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"the cpu platform needs a gloo process group, got backend {backend!r}"
            )
        self._group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums in place when `tensor` is contiguous, else into a contiguous copy."""
        target = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.all_reduce(target, group=self._group)
        return target

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        source = tensor.contiguous()
        parts = [torch.empty_like(source) for _ in range(self.world_size)]
        dist.all_gather(parts, source, group=self._group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Does not modify `tensor`."""
        world = self.world_size
        if tensor.shape[dim] % world:
            raise ValueError(
                f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible by the "
                f"world size {world}"
            )
        summed = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=self._group)
        return summed.chunk(world, dim=dim)[self.rank].contiguous()

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all: size {tensor.shape[0]} of dim 0 is not divisible by the world "
                f"size {self.world_size}"
            )
        source = tensor.contiguous()
        output = torch.empty_like(source)
        dist.all_to_all_single(output, source, group=self._group)
        return output

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), self._global_rank(dst), group=self._group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("recv needs a contiguous tensor to receive into")
        dist.recv(tensor, self._global_rank(src), group=self._group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        dist.broadcast(tensor, self._global_rank(src), group=self._group)
        return tensor

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def _global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"rank {group_rank} is outside the group of size {self.world_size}")
        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)


class SingleProcessCommunicator(Communicator):
    """The world of one process, used when torch.distributed is not initialised.

    Every collective returns its input's result for one rank; point-to-point calls are
    errors since there is no peer.
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.clone()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.clone()

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise ValueError(f"send to rank {dst}: a single-process world has no peer")

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise ValueError(f"recv from rank {src}: a single-process world has no peer")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if src != 0:
            raise ValueError(f"broadcast from rank {src} in a world of size 1")
        return tensor

    def barrier(self) -> None:
        return None


def make_communicator(group: dist.ProcessGroup | None) -> Communicator:
    """Gloo collectives over `group`; a one-rank world when nothing is initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleProcessCommunicator()
    return GlooCommunicator(group)
