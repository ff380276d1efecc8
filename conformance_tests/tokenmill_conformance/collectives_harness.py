"""Every collective of a plugin's communicator in a real multi-process group.

`run_groups` spawns the largest world size's processes once; each initialises
torch.distributed with the device's default backend (gloo on CPU) and loads the plugin.
Every check below runs on every dtype, first over the whole world (the default group,
`group=None`), then over a subgroup of the first ranks for each smaller world size (a
`torch.distributed.new_group`, so the plugin's communicator is also tested on a group). Each rank writes its results as it goes, so a
check that hangs the group fails with a timeout instead of hiding the others.
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.platforms.interfaces import Communicator
from tokenmill_conformance.session import PluginSource

COLLECTIVES = (
    "rank_and_world_size",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "send_recv",
    "broadcast",
    "barrier",
)
SHAPES = ((3, 4), (1,), (8, 5, 3))
_TIMEOUT_S = 120


def _base(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small integers, exact in every float dtype after summing over a few ranks."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) % 7).reshape(shape).to(dtype).to(device)


def _equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: got {tuple(got.shape)} {got.dtype}, expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    if not torch.equal(got.cpu(), expected.cpu()):
        raise AssertionError(f"{what}: got {got.flatten()[:8].tolist()}..., expected "
                             f"{expected.flatten()[:8].tolist()}...")


def _check(
    comm: Communicator, group: object | None, name: str, dtype: torch.dtype, device: torch.device
) -> None:
    rank, world = comm.rank, comm.world_size
    ranks_sum = world * (world + 1) // 2
    if name == "rank_and_world_size":
        expected = [dist.get_rank(group), dist.get_world_size(group)]
        _equal(torch.tensor([rank, world]), torch.tensor(expected), "(rank, world_size)")
    for shape in SHAPES:
        base = _base(shape, dtype, device)
        if name == "all_reduce":
            got = comm.all_reduce(base * (rank + 1))
            _equal(got, base * ranks_sum, f"all_reduce {shape}")
            if len(shape) == 2:
                strided = (base * (rank + 1)).t()
                _equal(comm.all_reduce(strided), (base * ranks_sum).t(), "all_reduce strided")
        elif name == "all_gather":
            x = base + rank
            for dim in range(len(shape)):
                expected = torch.cat([base + r for r in range(world)], dim=dim)
                _equal(comm.all_gather(x, dim=dim), expected, f"all_gather {shape} dim={dim}")
        elif name == "reduce_scatter":
            x = torch.cat([base] * world) * (rank + 1)
            before = x.clone()
            _equal(comm.reduce_scatter(x), base * ranks_sum, f"reduce_scatter {shape}")
            _equal(x, before, "reduce_scatter must not modify its input")
            if len(shape) >= 2:
                x = torch.cat([base] * world, dim=1) * (rank + 1)
                _equal(comm.reduce_scatter(x, dim=1), base * ranks_sum, "reduce_scatter dim=1")
        elif name == "all_to_all":
            x = torch.cat([base + 10 * rank + r for r in range(world)])  # chunk r -> rank r
            expected = torch.cat([base + 10 * r + rank for r in range(world)])
            _equal(comm.all_to_all(x), expected, f"all_to_all {shape}")
        elif name == "all_to_all_single":
            # uneven: rank s sends (s + 2 d) % 3 rows to rank d (some none), each row
            # telling sender and receiver apart
            _check_all_to_all_single(comm, base)
        elif name == "send_recv":
            dst, src = (rank + 1) % world, (rank - 1) % world
            out, buffer = base + rank, torch.empty_like(base)
            if rank % 2 == 0:
                comm.send(out, dst)
                got = comm.recv(buffer, src)
            else:
                got = comm.recv(buffer, src)
                comm.send(out, dst)
            _equal(got, base + src, f"send/recv {shape} ring")
        elif name == "broadcast":
            src = world - 1
            _equal(comm.broadcast(base + rank, src=src), base + src, f"broadcast {shape}")
        elif name == "barrier":
            comm.barrier()


def _uneven_count(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3


def _uneven_rows(base: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    rows = (base + 10 * src + dst).unsqueeze(0)
    return rows.repeat(_uneven_count(src, dst), *[1] * base.dim())


def _check_all_to_all_single(comm: Communicator, base: torch.Tensor) -> None:
    rank, world = comm.rank, comm.world_size
    x = torch.cat([_uneven_rows(base, rank, d) for d in range(world)])
    expected = torch.cat([_uneven_rows(base, s, rank) for s in range(world)])
    got = comm.all_to_all_single(
        x, [_uneven_count(s, rank) for s in range(world)],
        [_uneven_count(rank, d) for d in range(world)],
    )
    _equal(got, expected, f"all_to_all_single {tuple(base.shape)}")


def _worker(rank: int, worlds: list[int], store: str, source: PluginSource, dtypes: list[str],
            out_dir: str) -> None:
    world = max(worlds)
    results_path = Path(out_dir) / f"rank{rank}.jsonl"

    def record(check: str, error: str | None) -> None:
        with results_path.open("a") as f:
            f.write(json.dumps({"check": check, "error": error}) + "\n")

    try:
        active = source.load()
        device_type = active.platform.device_type
        backend = dist.Backend.default_device_backend_map.get(device_type, "gloo")
        if device_type != "cpu":
            torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        device = active.platform.device
        # every rank creates every subgroup, in the same order (torch.distributed's rule)
        groups = {w: None if w == world else dist.new_group(list(range(w))) for w in worlds}
    except Exception:  # recorded for the parent; the group cannot run without it
        record("<setup>", traceback.format_exc(limit=3))
        return
    try:
        for size in sorted(worlds, reverse=True):
            if rank >= size:
                continue
            comm = active.communicator(groups[size])
            for name in COLLECTIVES:
                for dtype_name in dtypes:
                    check = f"world{size}-{name}-{dtype_name}"
                    try:
                        _check(comm, groups[size], name, getattr(torch, dtype_name), device)
                    except Exception as exc:  # recorded per check; the next checks still run
                        record(check, f"rank {rank}: {exc}")
                    else:
                        record(check, None)
    except Exception:  # the communicator itself could not be made
        record("<setup>", traceback.format_exc(limit=3))
    finally:
        dist.destroy_process_group()


def run_groups(
    source: PluginSource, worlds: list[int], dtypes: list[str]
) -> dict[str, str | None]:
    """check id ('world2-all_reduce-float32') -> None when it passed on every rank of its
    group, else why not."""
    world = max(worlds)
    with tempfile.TemporaryDirectory(prefix="tokenmill-collectives-") as tmp:
        context = mp.start_processes(
            _worker, args=(worlds, f"{tmp}/store", source, dtypes, tmp), nprocs=world,
            join=False, start_method="spawn",
        )
        deadline = time.monotonic() + _TIMEOUT_S
        timed_out = False
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results: dict[str, str | None] = {}
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines:
                entry = json.loads(line)
                if entry["error"] or entry["check"] not in results:
                    results[entry["check"]] = entry["error"] or results.get(entry["check"])
            expected = sum(1 for w in worlds if rank < w) * len(COLLECTIVES) * len(dtypes)
            if len(lines) < expected and "<setup>" not in results:
                why = f"timed out after {_TIMEOUT_S} s" if timed_out else "exited early"
                results.setdefault("<incomplete>", f"rank {rank} {why} after {len(lines)} checks")
        return results


def check_result(results: dict[str, str | None], check: str, fail: Callable[[str], None]) -> None:
    for key in ("<setup>", "<incomplete>"):
        if results.get(key):
            fail(f"the process group failed: {results[key]}")
    if check not in results:
        fail(f"{check} did not run (an earlier check hung or crashed the group)")
    if results[check]:
        fail(f"{check}: {results[check]}")
