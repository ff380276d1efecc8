"""CUDA / HIP graphs of the decode step, per padded batch-size bucket (`tokenmill_graph_capture`).

Shared by the nvidia and rocm plugins: `torch.cuda.CUDAGraph` records HIP graphs on a ROCm
build of torch.

The core runner owns the static input buffers and pads each decode-only step to the
smallest bucket at least its size; this class records the forward once per bucket and
replays it. Every bucket's graph draws from one shared memory pool (captured largest
first, smaller graphs reuse its blocks), and each capture is preceded by two eager runs
on a side stream, so Triton's JIT compilation and cuBLAS's workspace allocation happen
outside the graph. The shared attention kernel's launch grid depends only on the token and
sequence counts, which a bucket fixes, and under capture it always splits long contexts
(split-K), so one graph serves every context length.

After a sleep / wake of the KV allocator the arena has new device addresses: graphs
captured before must be captured again (the engine re-creates its runner).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.platforms.interfaces import GraphCapture

# vLLM's shape of buckets: dense at small batches, where padding costs the most
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448,
           512)
_WARMUP_RUNS = 2


class CudaGraphCapture(GraphCapture):
    """One `torch.cuda.CUDAGraph` per bucket, sharing a memory pool."""  # HIP on ROCm

    def __init__(self) -> None:
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: object | None = None

    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        """The buckets below `max_num_seqs`, and `max_num_seqs` itself (at most 512), so a
        full batch is captured too."""
        return sorted({b for b in BUCKETS if b < max_num_seqs} | {min(max_num_seqs, BUCKETS[-1])})

    def capture(self, batch_size: int, fn: Callable[[], torch.Tensor]) -> None:
        if batch_size in self._graphs:
            raise ValueError(f"batch size {batch_size} is already captured")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = fn()
        self._graphs[batch_size] = graph
        self._outputs[batch_size] = output

    def replay(self, batch_size: int) -> torch.Tensor:
        graph = self._graphs.get(batch_size)
        if graph is None:
            raise KeyError(f"no graph was captured for batch size {batch_size}; captured: "
                           f"{sorted(self._graphs)}")
        graph.replay()
        return self._outputs[batch_size]
