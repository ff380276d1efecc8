"""Collectives over XLA: every `Communicator` method as a jitted `shard_map` program over a
mesh of one device per rank of the group.

Multi-controller JAX: each rank is a process that has joined `jax.distributed`; a
collective is one SPMD program over the group's devices (each rank's first local device),
and every rank of the group runs it with its own shard. On a TPU the collectives travel
over ICI; on JAX's CPU backend XLA runs them through its gloo CPU collectives. Only the
bootstrap uses `torch.distributed`: the group identities come from the torch process
group the core hands over, and rank 0 of the world broadcasts the JAX coordinator's port
through it once.

Rules: the first communicator of a process must be created on every rank of the world
(it joins `jax.distributed` collectively, before JAX is used for anything else); `send`
and `recv` are a two-device `ppermute`, so each send must meet its matching recv.
Ranks in the method arguments are ranks within the communicator's group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from functools import partial

import jax
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tokenmill.platforms.communicators import SingleProcessCommunicator, no_process_group
from tokenmill.platforms.interfaces import Communicator
from tokenmill_tpu.convert import to_numpy, to_torch

AXIS = "ranks"
COORDINATOR_HOST_ENV = "MASTER_ADDR"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_jax_distributed(backend: str) -> None:
    """Join `jax.distributed` once per process, as torch.distributed's world: world rank 0
    hosts the coordinator and broadcasts its port over the torch world group."""
    if jax.distributed.is_initialized():
        return
    port = torch.tensor([_free_port() if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(port, src=0)
    if backend == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = os.environ.get(COORDINATOR_HOST_ENV, "127.0.0.1")
    address = f"{host}:{int(port.item())}"
    # the coordinator (on rank 0) listens on that host only, not JAX's default 0.0.0.0
    jax.distributed.initialize(
        address, num_processes=dist.get_world_size(), process_id=dist.get_rank(),
        coordinator_bind_address=address,
    )


def _rank_device(process: int) -> jax.Device:
    return min((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


class XlaCommunicator(Communicator):
    """Every collective over the ranks of one torch process group, as XLA programs."""

    def __init__(self, group: dist.ProcessGroup | None, backend: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; the tpu communicator takes its ranks "
                "from a torch process group (init_process_group first)"
            )
        join_jax_distributed(backend)
        self._group = group
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._rank = dist.get_rank(group)
        self._programs: dict[tuple, Callable] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns a new tensor (the input is not modified)."""
        return self._run(("all_reduce",), lambda x: jax.lax.psum(x, AXIS), tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = dim % tensor.dim()
        return self._run(("all_gather", dim), partial(_all_gather, dim=dim), tensor)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Does not modify `tensor`."""
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible by "
                f"the world size {self.world_size}"
            )
        return self._run(("reduce_scatter", dim), partial(_reduce_scatter, dim=dim), tensor)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all: size {tensor.shape[0]} of dim 0 is not divisible by the world "
                f"size {self.world_size}"
            )
        return self._run(("all_to_all",), _all_to_all, tensor)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._check_rank(dst)
        self._pair(tensor, src=self._rank, dst=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receives into `tensor` (shape and dtype must match the sender's) and returns it."""
        self._check_rank(src)
        tensor.copy_(self._pair(torch.zeros_like(tensor), src=src, dst=self._rank))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Sets `tensor` to rank `src`'s and returns it."""
        self._check_rank(src)
        tensor.copy_(self._run(("broadcast", src), partial(_broadcast, src=src), tensor))
        return tensor

    def barrier(self) -> None:
        self._run(("barrier",), lambda x: jax.lax.psum(x, AXIS), torch.zeros(1))

    # -- programs ------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the group of size {self.world_size}")

    def _pair(self, tensor: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        """A two-rank ppermute from group rank `src` to `dst`, run by both of them."""
        if src == dst:
            raise ValueError(f"send/recv between rank {src} and itself")
        pair = sorted((src, dst))
        perm = [(pair.index(src), pair.index(dst))]
        shift = partial(jax.lax.ppermute, axis_name=AXIS, perm=perm)
        return self._run(("pair", src, dst), shift, tensor, members=pair)

    def _run(
        self,
        key: tuple,
        body: Callable[[jax.Array], jax.Array],
        tensor: torch.Tensor,
        members: list[int] | None = None,
    ) -> torch.Tensor:
        """Run `body` as an SPMD program over the group ranks `members` (default: all),
        this rank contributing `tensor`; returns this rank's result as a torch tensor."""
        members = list(range(self.world_size)) if members is None else members
        with jax.enable_x64(True):  # int64 token ids travel as int64
            mesh = Mesh(np.array([_rank_device(self._ranks[r]) for r in members]), (AXIS,))
            program = self._programs.get(key)
            if program is None:
                program = jax.jit(jax.shard_map(
                    lambda x: body(x[0])[None], mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                ))
                self._programs[key] = program
            local = to_numpy(tensor)
            shard = jax.device_put(local[None], _rank_device(self._ranks[self._rank]))
            sharding = NamedSharding(mesh, P(AXIS))
            global_shape = (len(members), *local.shape)
            x = jax.make_array_from_single_device_arrays(global_shape, sharding, [shard])
            out = program(x)
            result = to_torch(out.addressable_shards[0].data[0])
        return result.to(tensor.device)


def _all_gather(x: jax.Array, dim: int) -> jax.Array:
    return jax.lax.all_gather(x, AXIS, axis=dim, tiled=True)


def _reduce_scatter(x: jax.Array, dim: int) -> jax.Array:
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True)


def _all_to_all(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True)


def _broadcast(x: jax.Array, src: int) -> jax.Array:
    return jax.lax.all_gather(x, AXIS)[src]


def make_communicator(group: object | None, backend: str) -> Communicator:
    if no_process_group(group):
        return SingleProcessCommunicator()
    return XlaCommunicator(group, backend)  # type: ignore[arg-type]


__all__ = ["SingleProcessCommunicator", "XlaCommunicator", "make_communicator"]
