"""One rank of a calibration process group (`python -m tokenmill.planner.group_bench`):
joins the group as an engine's worker does (the platform's communicator over
torch.distributed), times every collective at several sizes, then runs the kernel
measurements while every other rank runs them too (what a rank of a multi-rank mix gets
of a shared host), and writes what it measured as JSON. Started by
`tokenmill.planner.calibrate` in a process of its own per rank: plain arguments in, a JSON
file out, nothing pickled."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SIZES = (256, 4096, 65536, 1 << 20, 4 << 20)  # payload bytes per rank
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def time_collective(comm, op: str, size: int, world: int, rank: int, device, repeats: int) -> float:
    """Median seconds of one call with `size` payload bytes (as the counting communicator
    counts them: all_gather's result, the others' input)."""
    elems = max(world, size // 4) // world * world
    x = torch.ones(elems if op != "all_gather" else elems // world, dtype=torch.float32,
                   device=device)

    def call() -> None:
        if op == "all_reduce":
            comm.all_reduce(x.clone())
        elif op == "all_gather":
            comm.all_gather(x)
        elif op == "reduce_scatter":
            comm.reduce_scatter(x)
        elif op == "all_to_all":
            comm.all_to_all(x)
        elif rank % 2 == 0 and rank + 1 < world:
            comm.send(x, rank + 1)
        elif rank % 2 == 1:
            comm.recv(x.clone(), rank - 1)

    call()
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--platform", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default=None, help="the kernels' dtype (default: the platform's)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="collectives only (a host whose ranks do not share devices)")
    args = parser.parse_args()

    from tokenmill.distributed.mp import share_host_cores
    from tokenmill.distributed.parallel_state import (
        ParallelLayout,
        destroy_parallel_state,
        init_parallel_state,
    )
    from tokenmill.planner.kernel_bench import all_points, point_dict
    from tokenmill.platforms.registry import load_platform

    # the ranks run as an engine's mp workers do: each with its share of the host's cores
    # (measured with torch's thread a core in every rank, collectives and kernels ran
    # oversubscribed, and tp2 was predicted 62% slow where the engine's ranks share)
    share_host_cores(args.world, args.rank)

    active = load_platform(args.platform)
    layout = ParallelLayout.of(("tp",), tp=args.world)
    state = init_parallel_state(layout, args.rank, active, args.init_method)
    comm = state.tp.communicator
    device = active.platform.device
    repeats = 3 if args.quick else 7
    collectives = {op: {str(size): time_collective(comm, op, size, args.world, args.rank,
                                                   device, repeats) for size in SIZES}
                   for op in OPS}
    comm.barrier()
    points = [] if args.no_kernels else [
        point_dict(p) for p in all_points(active, quick=args.quick,
                            dtype=getattr(torch, args.dtype) if args.dtype else None)]
    comm.barrier()
    Path(args.out).write_text(json.dumps({"rank": args.rank, "world": args.world,
                                          "collectives": collectives, "points": points}))
    destroy_parallel_state()


if __name__ == "__main__":
    main()
