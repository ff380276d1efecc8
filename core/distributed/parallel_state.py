"""Process groups for every product of the parallel dimensions, and the communicator of each.

Layout: the world's ranks form a grid of `dims` (outermost first, default
`("dp", "pp", "tp")`); a rank's coordinates are its digits in that mixed radix, the last
dimension varying fastest:

    rank = ((dp_index * pp_size) + pp_index) * tp_size + tp_index        (dims dp, pp, tp)

so the ranks of one TP group are contiguous (they talk most, on a host they share the
fastest links), a PP group strides by tp and a DP group by tp * pp. A *group of dimension
d* holds the ranks that agree on every coordinate but d's; each rank belongs to exactly
one group per dimension. Any further dimension (ep, cp, ...) is a name in `dims` and a
size in `sizes`: nothing here knows what a dimension means.

The groups are torch.distributed groups over the process-group backend given to
`init_parallel_state` (gloo: torch's own, over TCP, which every platform can use for
rendezvous and small control tensors); each group gets the active platform's communicator
(`ActivePlatform.communicator(group)`), which is what the model calls for collectives. A
platform whose collectives need another transport builds it from the group it is handed.

`init_parallel_state` joins the world and returns this rank's `ParallelState`, which its
owner (the worker) hands to whatever needs it (the model, built with it);
`ParallelState.single()` is the state of a process that runs alone, and
`destroy_parallel_state` tears the process groups down.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tokenmill.distributed.rendezvous import join_world
from tokenmill.platforms.interfaces import Communicator

DEFAULT_DIMS = ("dp", "pp", "tp")


class CountingCommunicator(Communicator):
    """A group's communicator that counts what passes through it: per collective, the
    calls and the payload bytes this rank hands in (for all_gather, the gathered result's:
    what every rank ends up holding). Counting is two integer adds beside a collective."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _count(self, op: str, num_bytes: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + num_bytes

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def all_reduce(self, tensor):
        self._count("all_reduce", tensor.numel() * tensor.element_size())
        return self.inner.all_reduce(tensor)

    def all_gather(self, tensor, dim: int = 0):
        self._count("all_gather", tensor.numel() * tensor.element_size() * self.world_size)
        return self.inner.all_gather(tensor, dim)

    def reduce_scatter(self, tensor, dim: int = 0):
        self._count("reduce_scatter", tensor.numel() * tensor.element_size())
        return self.inner.reduce_scatter(tensor, dim)

    def all_to_all(self, tensor):
        self._count("all_to_all", tensor.numel() * tensor.element_size())
        return self.inner.all_to_all(tensor)

    def all_to_all_single(self, tensor, output_split_sizes, input_split_sizes):
        self._count("all_to_all_single", tensor.numel() * tensor.element_size())
        return self.inner.all_to_all_single(tensor, output_split_sizes, input_split_sizes)

    def send(self, tensor, dst: int) -> None:
        self._count("send", tensor.numel() * tensor.element_size())
        self.inner.send(tensor, dst)

    def recv(self, tensor, src: int):
        self._count("recv", tensor.numel() * tensor.element_size())
        return self.inner.recv(tensor, src)

    def broadcast(self, tensor, src: int = 0):
        self._count("broadcast", tensor.numel() * tensor.element_size())
        return self.inner.broadcast(tensor, src)

    def barrier(self) -> None:
        self._count("barrier", 0)
        self.inner.barrier()


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The grid of ranks: `dims` (outermost first) and their `sizes`."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes) or len(set(self.dims)) != len(self.dims):
            raise ValueError(f"dims {self.dims} and sizes {self.sizes} must pair up, names unique")
        bad = [(d, s) for d, s in zip(self.dims, self.sizes) if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"parallel sizes must be positive integers, got {bad}")

    @classmethod
    def of(cls, dims: Sequence[str] = DEFAULT_DIMS, **sizes: int) -> ParallelLayout:
        """A layout over `dims` with sizes by name (missing ones are 1): `of(tp=2, pp=2)`."""
        unknown = set(sizes) - set(dims)
        if unknown:
            raise ValueError(f"sizes given for {sorted(unknown)}, which are not in dims {tuple(dims)}")
        return cls(tuple(dims), tuple(int(sizes.get(d, 1)) for d in dims))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, dim: str) -> int:
        return self.sizes[self._index(dim)]

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of `rank`, by dimension name."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out: dict[str, int] = {}
        for dim, size in zip(reversed(self.dims), reversed(self.sizes)):
            rank, out[dim] = divmod(rank, size)
        return {d: out[d] for d in self.dims}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim, size in zip(self.dims, self.sizes):
            index = coords.get(dim, 0)
            if not 0 <= index < size:
                raise ValueError(f"coordinate {dim}={index} is outside size {size}")
            rank = rank * size + index
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: the ranks that differ only in `dim`, in its order."""
        self._index(dim)
        seen: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            others = tuple(v for d, v in self.coords(rank).items() if d != dim)
            seen.setdefault(others, []).append(rank)
        return list(seen.values())

    def group_of(self, dim: str, rank: int) -> list[int]:
        return next(g for g in self.groups(dim) if rank in g)

    def _index(self, dim: str) -> int:
        if dim not in self.dims:
            raise ValueError(f"dimension {dim!r} is not in the layout's {self.dims}")
        return self.dims.index(dim)


@dataclasses.dataclass(frozen=True)
class GroupCoordinator:
    """This rank's group of one dimension: its ranks (global), its rank within it, and the
    platform communicator over it (None for a group of one: nothing to communicate)."""

    dim: str
    ranks: tuple[int, ...]
    rank_in_group: int
    communicator: CountingCommunicator | None
    process_group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """This rank's groups. `expert_parallel` (vLLM's enable_expert_parallel): a MoE layer's
    experts are split over the TP group's ranks (`ep`), each expert whole on one rank,
    instead of every expert's intermediate dim being split over them (`moe_tp`).
    `sequence_parallel` (vLLM's enable_sequence_parallelism): between TP regions the
    activations are split along the tokens (core/model/parallel.py)."""

    layout: ParallelLayout
    rank: int
    groups: dict[str, GroupCoordinator]
    expert_parallel: bool = False
    sequence_parallel: bool = False

    @classmethod
    def single(cls) -> ParallelState:
        """The state of a process that runs alone: every dimension a group of one."""
        return cls(ParallelLayout.of(), 0, {})

    def group(self, dim: str) -> GroupCoordinator:
        if dim not in self.groups:
            return GroupCoordinator(dim, (self.rank,), 0, None)  # a dimension of size 1
        return self.groups[dim]

    @property
    def tp(self) -> GroupCoordinator:
        return self.group("tp")

    @property
    def ep(self) -> GroupCoordinator:
        """The group a MoE layer's experts are split over (a group of one without EP)."""
        return self.tp if self.expert_parallel else self.group("ep")

    @property
    def moe_tp(self) -> GroupCoordinator:
        """The group each expert's intermediate dim is split over (one rank with EP)."""
        return self.group("moe_tp") if self.expert_parallel else self.tp

    def communicated_bytes(self) -> dict[str, int]:
        """Payload bytes through each dimension's communicator so far ({} on one rank)."""
        return {
            dim: sum(g.communicator.bytes.values())
            for dim, g in self.groups.items() if g.communicator is not None
        }


def build_groups(layout: ParallelLayout, rank: int, platform: Any) -> dict[str, GroupCoordinator]:
    """This rank's group of every dimension, over an initialised torch.distributed world.

    Every rank must call this with the same layout: `dist.new_group` is collective, so
    every group of every dimension is created on every rank, in the same order.
    """
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the layout {dict(zip(layout.dims, layout.sizes))} needs {layout.world_size} "
            f"ranks; torch.distributed has {dist.get_world_size()}"
        )
    out: dict[str, GroupCoordinator] = {}
    for dim in layout.dims:
        for ranks in layout.groups(dim):
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                communicator = (
                    CountingCommunicator(platform.communicator(group)) if group is not None else None
                )
                out[dim] = GroupCoordinator(dim, tuple(ranks), ranks.index(rank), communicator, group)
    return out


def init_parallel_state(
    layout: ParallelLayout,
    rank: int,
    platform: Any,
    init_method: str,
    backend: str = "gloo",
    expert_parallel: bool = False,
    sequence_parallel: bool = False,
) -> ParallelState:
    """Join the world (`init_method`: e.g. "tcp://127.0.0.1:PORT", the same on every rank)
    and build every group of `layout`; returns this rank's state. `platform` is the
    ActivePlatform whose communicator each group gets; `expert_parallel` splits MoE
    experts over the TP group, `sequence_parallel` the activations between TP regions
    along the tokens (ParallelState). RuntimeError when this process has joined a world
    already (one per process: `destroy_parallel_state` leaves it)."""
    if layout.world_size > 1:
        if dist.is_initialized():
            raise RuntimeError("this process has joined a torch.distributed world already; "
                               "destroy_parallel_state() first")
        join_world(init_method, backend, rank, layout.world_size)
        groups = build_groups(layout, rank, platform)
    else:
        groups = {}
    return ParallelState(layout, rank, groups, expert_parallel, sequence_parallel)


def destroy_parallel_state() -> None:
    """Leave the torch.distributed world this process joined (nothing when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
