"""The certification tiers, in order, and what each one means for a certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().with_name("suite")


@dataclass(frozen=True, slots=True)
class Tier:
    id: str  # "T0".."T5"
    title: str
    required: bool  # a certificate needs it to pass
    waivable: bool  # a plugin's waivers apply to its tests (core tiers: never)


TIERS = (
    Tier("T0", "contract: discovery, API version, hook names and signatures, returned objects",
         required=True, waivable=False),
    Tier("T1", "ops against the core reference: attention, ops, collectives, allocators",
         required=True, waivable=False),
    Tier("T2", "KV movement: block copy, swap out and in, round trips",
         required=True, waivable=False),
    Tier("T3", "end-to-end greedy equality with the reference platform on tiny models",
         required=True, waivable=False),
    Tier("T4", "serving smoke through the OpenAI and Anthropic HTTP APIs",
         required=True, waivable=True),
    Tier("T5", "performance report against the declared hardware spec (not pass/fail)",
         required=False, waivable=True),
)
TIER_BY_ID = {tier.id: tier for tier in TIERS}


def suite_id(path: Path, nodeid: str) -> str:
    """A test's id relative to the suite folder, whatever pytest's rootdir was:
    't1/test_attention.py::test_x[params]'. This is the id waivers name."""
    relative = Path(path).resolve().relative_to(SUITE_DIR).as_posix()
    _, sep, rest = nodeid.partition("::")
    return relative + sep + rest


def tier_of(test_id: str) -> str:
    """'t1/test_attention.py::test_x[...]' -> 'T1'."""
    head = test_id.split("/", 1)[0].upper()
    if head not in TIER_BY_ID:
        raise ValueError(f"test {test_id!r} is not inside a tier folder t0..t5")
    return head


def parse_tiers(text: str) -> list[str]:
    """'T1', 't0,t2', 'T0-T3' or 'T0..T3' -> the tier ids, in order."""
    chosen: set[str] = set()
    for part in text.replace(" ", "").upper().split(","):
        if not part:
            continue
        for sep in ("..", "-"):
            if sep in part:
                first, last = part.split(sep, 1)
                break
        else:
            first = last = part
        ids = [tier.id for tier in TIERS]
        if first not in ids or last not in ids:
            raise ValueError(f"unknown tier {part!r}; tiers are {ids} (ranges like T0-T3)")
        chosen.update(ids[ids.index(first) : ids.index(last) + 1])
    return [tier.id for tier in TIERS if tier.id in chosen]
