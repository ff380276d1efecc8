"""Communicators any plugin can reuse: collectives over torch.distributed, and the world of
one process. A plugin names the process-group backends it accepts (gloo on CPU, its
accelerator's own elsewhere) and which of them have a native reduce-scatter and a one-tensor
all-gather; on the others those are an all-reduce plus a slice and a list all-gather.
Ranks in the method arguments are ranks within the communicator's group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.platforms.interfaces import Communicator


class TorchDistributedCommunicator(Communicator):
    """Every `Communicator` collective over one torch.distributed process group (None: the
    world)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        accepted_backends: frozenset[str],
        platform_name: str,
        native_backends: frozenset[str] = frozenset(),
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call torch.distributed."
                f"init_process_group({sorted(accepted_backends)[0]!r}, ...) before asking the "
                f"{platform_name} platform for a communicator over a group"
            )
        backend = dist.get_backend(group)
        # one name, or per device type as "cpu:gloo,<device>:<backend>"
        names = {part.rpartition(":")[2] for part in backend.split(",")}
        if not names & accepted_backends:
            raise ValueError(
                f"the {platform_name} platform needs a process group with backend "
                f"{' or '.join(sorted(accepted_backends))}, got {backend!r}"
            )
        self._group = group
        self._native = bool(names & native_backends)

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
        world = self.world_size
        if self._native:  # one call into one buffer, rank-major
            out = source.new_empty((world * source.shape[0], *source.shape[1:]))
            dist.all_gather_into_tensor(out, source, group=self._group)
            return out if dim == 0 else torch.cat(out.chunk(world), dim=dim)
        parts = [torch.empty_like(source) for _ in range(world)]
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
        if self._native:
            # chunks along `dim` laid out one after another, as reduce_scatter_tensor wants
            source = torch.cat(tensor.chunk(world, dim=dim), dim=0).contiguous()
            out = source.new_empty((source.shape[0] // world, *source.shape[1:]))
            dist.reduce_scatter_tensor(out, source, group=self._group)
            return out
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

    def all_to_all_single(
        self, tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
    ) -> torch.Tensor:
        """One native uneven all-to-all (gloo's alltoallv); see `Communicator`."""
        if sum(input_split_sizes) != tensor.shape[0]:
            raise ValueError(
                f"all_to_all_single: input split sizes {input_split_sizes} do not add up to "
                f"the {tensor.shape[0]} rows given"
            )
        source = tensor.contiguous()
        output = source.new_empty((sum(output_split_sizes), *source.shape[1:]))
        dist.all_to_all_single(
            output, source, list(output_split_sizes), list(input_split_sizes), group=self._group
        )
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
    """The world of one process, when torch.distributed is not initialised: collectives
    return the one rank's result; point-to-point calls are errors (there is no peer)."""

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

    def all_to_all_single(
        self, tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
    ) -> torch.Tensor:
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


def no_process_group(group: object | None) -> bool:
    """True when there is no group to talk over: none given and torch.distributed is not
    initialised (then a plugin's communicator is the one-process world)."""
    return group is None and not (dist.is_available() and dist.is_initialized())


def make_communicator(
    group: dist.ProcessGroup | None,
    accepted_backends: frozenset[str],
    platform_name: str,
    native_backends: frozenset[str] = frozenset(),
) -> Communicator:
    """Collectives over `group`; the one-process world when nothing is initialised."""
    if no_process_group(group):
        return SingleProcessCommunicator()
    return TorchDistributedCommunicator(group, accepted_backends, platform_name, native_backends)
