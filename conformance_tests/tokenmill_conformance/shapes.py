"""Production shapes for tier T1: which attention cases a certification runs.

The shapes real models run are a product (head size 64/128/256 x GQA ratio 1/4/8 x each
declared dtype x each declared block size x window shorter or longer than a block), too
many to run whole on a slow platform. The suite runs a deterministic sample of it, the
same on every run and for every plugin with the same capabilities:

- the corners: every combination of the smallest and largest head size, GQA ratio and
  block size, per attention kind and dtype, with both window lengths for sliding windows;
- coverage: every value of every dimension in at least one case;
- `extra` more cases drawn from the rest with a fixed seed.

The batches themselves (`sweep_batch`, `LONG_BATCHES`) cross each kernel's path switches:
prefill chunks longer than a query tile, chunks starting on and off block boundaries,
decodes just below and far past the 2,048-token context where split-K kernels switch, and
a prefill chunk after more than 8k tokens of context.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from tokenmill.platforms.interfaces import AttentionKind, Capabilities

HEAD_SIZES = (64, 128, 256)
GQA_RATIOS = (1, 4, 8)
NUM_KV_HEADS = 2  # two KV heads, so that a wrong query-head -> KV-head mapping shows
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW)
SAMPLE_SEED = 25
LONG_CONTEXT = 8192
# sliding window of the long-context cases: shorter than the context, split across
# split-K segments
LONG_WINDOW = 1000


@dataclass(frozen=True, slots=True)
class ShapeCase:
    """One attention case of the sample; `window` is "short" (shorter than a block) or
    "long" (several blocks) for sliding windows, None for full attention."""

    kind: AttentionKind
    dtype: torch.dtype
    head_size: int
    group: int
    block_size: int
    window: str | None

    @property
    def id(self) -> str:
        words = [self.kind.value, str(self.dtype).removeprefix("torch."),
                 f"head{self.head_size}", f"gqa{self.group}", f"block{self.block_size}"]
        return "-".join(words + ([f"{self.window}_window"] if self.window else []))

    def window_tokens(self) -> int | None:
        """The window in tokens: 'short' is half a block plus one, 'long' three blocks and
        five tokens (so neither lines up with a block boundary)."""
        if self.window is None:
            return None
        if self.window == "short":
            return max(1, self.block_size // 2 + 1)
        return 3 * self.block_size + 5


def _dimensions(caps: Capabilities) -> dict[str, list]:
    heads = [h for h in HEAD_SIZES if h in caps.head_sizes] or sorted(caps.head_sizes)
    return {
        "kind": [k for k in KINDS if k in caps.attention_kinds],
        "dtype": [d for d in DTYPES if d in caps.dtypes],
        "head_size": heads,
        "group": list(GQA_RATIOS),
        "block_size": sorted(caps.block_sizes),
    }


def _product(dims: dict[str, list]) -> list[ShapeCase]:
    cases = []
    for kind, dtype, head, group, block in itertools.product(*dims.values()):
        windows = ["short", "long"] if kind is AttentionKind.SLIDING_WINDOW else [None]
        cases += [ShapeCase(kind, dtype, head, group, block, w) for w in windows]
    return cases


def production_cases(caps: Capabilities, extra: int) -> list[ShapeCase]:
    """The sample (module docstring), in a stable order."""
    dims = _dimensions(caps)
    everything = _product(dims)
    ends = {name: {values[0], values[-1]} for name, values in dims.items() if values}
    chosen = [c for c in everything
              if c.head_size in ends["head_size"] and c.group in ends["group"]
              and c.block_size in ends["block_size"]]
    for name, values in dims.items():  # coverage of every value
        for value in values:
            if not any(getattr(c, name) == value for c in chosen):
                chosen.append(next(c for c in everything if getattr(c, name) == value))
    rest = [c for c in everything if c not in chosen]
    chosen += random.Random(SAMPLE_SEED).sample(rest, min(extra, len(rest)))
    return chosen


def sweep_batch(block_size: int) -> list[tuple[int, int]]:
    """(cached, new) per sequence of one step at a shape: a one-token prompt, a fresh
    prompt over several blocks, a chunk on a block boundary, a chunk of 70 tokens (longer
    than a 64-row query tile) off one, and decodes at contexts around a block and a few
    hundred tokens."""
    b = block_size
    return [(0, 1), (0, 3 * b + 5), (2 * b, b + 3), (37, 70), (1, 1), (b - 1, 1), (b, 1),
            (300, 1), (611, 1)]


# scenario -> (cached, new) per sequence: decodes on both sides of a 2,048-token split-K
# switch and past 8k, and a 72-token prefill chunk (two 64-row query tiles) after 8k
# tokens of context next to decodes
LONG_BATCHES = {
    "long_decode": [(LONG_CONTEXT + 5, 1), (4095, 1), (2047, 1), (16, 1)],
    "long_prefill": [(LONG_CONTEXT - 40, 72), (3000, 1), (0, 1)],
}


@dataclass(frozen=True, slots=True)
class LongCase:
    """A long-context step at one shape: per kind, dtype and scenario; the largest head
    size and GQA ratio decode, a middle shape prefills (fewer rows per query tile)."""

    kind: AttentionKind
    dtype: torch.dtype
    scenario: str
    head_size: int
    group: int
    block_size: int

    @property
    def id(self) -> str:
        return "-".join([self.kind.value, str(self.dtype).removeprefix("torch."),
                         self.scenario, f"head{self.head_size}", f"gqa{self.group}",
                         f"block{self.block_size}"])

    def window_tokens(self) -> int | None:
        return LONG_WINDOW if self.kind is AttentionKind.SLIDING_WINDOW else None


def long_cases(caps: Capabilities) -> list[LongCase]:
    dims = _dimensions(caps)
    heads, blocks = dims["head_size"], dims["block_size"]
    middle_head = heads[len(heads) // 2]
    cases = []
    for kind in dims["kind"]:
        for dtype in dims["dtype"]:
            cases.append(LongCase(kind, dtype, "long_decode", heads[-1], GQA_RATIOS[-1],
                                  blocks[0]))
            cases.append(LongCase(kind, dtype, "long_prefill", middle_head, GQA_RATIOS[0],
                                  blocks[-1]))
    return cases
