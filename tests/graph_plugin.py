"""A test platform: the CPU plugin plus decode-step "graphs" that are honest on a CPU.

`ReplayingGraphs.capture` runs the forward once (as a CUDA graph capture does) and keeps
the closure, which reads the runner's static buffers; `replay` reruns that closure over
the same buffers. Outputs are right only if the core runner really writes each step into
the static buffers (tokens, positions, slots, block tables, lengths) and pads correctly,
which is what the nvidia plugin's CUDA graphs will rely on. It counts what it did.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import pluggy
import torch

from tokenmill.platforms.interfaces import GraphCapture, Platform
from tokenmill_cpu import plugin as cpu

hookimpl = pluggy.HookimplMarker("tokenmill")


class ReplayingGraphs(GraphCapture):
    def __init__(self, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> None:
        self.sizes = sizes
        self.captured: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()

    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        return [n for n in self.sizes if n <= max_num_seqs] or [1]

    def capture(self, batch_size: int, fn: Callable[[], torch.Tensor]) -> None:
        out = fn()
        assert out.shape[0] == batch_size, (out.shape, batch_size)
        self.captured[batch_size] = fn

    def replay(self, batch_size: int) -> torch.Tensor:
        self.replays[batch_size] += 1
        return self.captured[batch_size]()


class GraphsPlugin:
    """The CPU plugin's hooks, with `capabilities.graphs` and `tokenmill_graph_capture`."""

    def __init__(self) -> None:
        self.graphs: list[ReplayingGraphs] = []  # one per engine (worker) built

    @hookimpl
    def tokenmill_api_version(self) -> str:
        return cpu.tokenmill_api_version()  # it serves the cpu plugin's ops: its version too

    @hookimpl
    def tokenmill_detect(self):
        return cpu.tokenmill_detect()

    @hookimpl
    def tokenmill_platform(self) -> Platform:
        base = cpu.tokenmill_platform()
        caps = dataclasses.replace(base.capabilities, graphs=True)
        return dataclasses.replace(base, name="cpu-graphs", capabilities=caps)

    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return cpu.tokenmill_attention_backends(platform)

    @hookimpl
    def tokenmill_communicator(self, platform, group):
        return cpu.tokenmill_communicator(platform, group)

    @hookimpl
    def tokenmill_allocator(self, platform, purpose):
        return cpu.tokenmill_allocator(platform, purpose)

    @hookimpl
    def tokenmill_ops(self, platform):
        return cpu.tokenmill_ops(platform)

    @hookimpl
    def tokenmill_hardware_spec(self, platform):
        return cpu.tokenmill_hardware_spec(platform)

    @hookimpl
    def tokenmill_graph_capture(self, platform) -> GraphCapture:
        graphs = ReplayingGraphs()
        self.graphs.append(graphs)
        return graphs


PLUGIN = GraphsPlugin()  # for `tokenmill-conformance --plugin tests/graph_plugin.py:PLUGIN`
