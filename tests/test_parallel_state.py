"""The parallel-state module: the rank -> coordinates layout (pure), and real gloo process
groups for products of dimensions in a spawned 4-process world on loopback, each group
summing exactly its own ranks through the cpu platform's communicator."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tokenmill.distributed.parallel_state import ParallelLayout


def test_layout_tp_is_innermost():
    layout = ParallelLayout.of(tp=2, pp=3, dp=2)
    assert layout.world_size == 12
    assert layout.coords(0) == {"dp": 0, "pp": 0, "tp": 0}
    assert layout.coords(1) == {"dp": 0, "pp": 0, "tp": 1}
    assert layout.coords(2) == {"dp": 0, "pp": 1, "tp": 0}
    assert layout.coords(7) == {"dp": 1, "pp": 0, "tp": 1}
    for rank in range(12):
        assert layout.rank_of(layout.coords(rank)) == rank
    assert layout.groups("tp") == [[2 * i, 2 * i + 1] for i in range(6)]
    assert layout.groups("pp") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert layout.groups("dp") == [[i, i + 6] for i in range(6)]


def test_every_rank_is_in_one_group_per_dimension():
    layout = ParallelLayout.of(("dp", "pp", "ep", "tp"), tp=2, ep=2, pp=2, dp=1)
    for dim in layout.dims:
        members = sorted(r for g in layout.groups(dim) for r in g)
        assert members == list(range(layout.world_size))
        assert all(len(g) == layout.size(dim) for g in layout.groups(dim))


def test_bad_layouts_name_the_value():
    with pytest.raises(ValueError, match="positive"):
        ParallelLayout.of(tp=0)
    with pytest.raises(ValueError, match="'xp'"):
        ParallelLayout.of(xp=2)
    with pytest.raises(ValueError, match="outside"):
        ParallelLayout.of(tp=2).coords(2)


LAYOUTS = [{"tp": 2, "pp": 2}, {"tp": 2, "dp": 2}, {"tp": 4}, {"pp": 2, "dp": 2}]


def _rank_main(rank: int, world: int, init_method: str) -> None:
    """One rank: build every layout's groups and check each group's sum (a failure here
    fails mp.spawn with this rank's traceback)."""
    import torch.distributed as dist

    from tokenmill.distributed import parallel_state
    from tokenmill.platforms.registry import PlatformRegistry, load_platform

    platform = load_platform("cpu", PlatformRegistry.discover())
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    for sizes in LAYOUTS:
        layout = ParallelLayout.of(**sizes)
        groups = parallel_state.build_groups(layout, rank, platform)
        sums = {}
        for dim, group in groups.items():
            # each rank adds 2**rank: a group's sum names exactly its members
            if group.communicator is None:
                sums[dim] = 1 << rank
                continue
            assert group.communicator.world_size == group.world_size
            assert group.communicator.rank == group.rank_in_group
            sums[dim] = int(group.communicator.all_reduce(torch.tensor([1 << rank])).item())
            assert group.communicator.bytes == {"all_reduce": 8}  # one int64 counted
        want = {d: sum(1 << r for r in layout.group_of(d, rank)) for d in layout.dims}
        assert sums == want, (sizes, rank, sums, want)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_groups_of_every_dimension_reduce_over_their_own_ranks():
    mp.spawn(_rank_main, args=(4, f"tcp://127.0.0.1:{_free_port()}"), nprocs=4, join=True)
