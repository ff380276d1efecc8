"""The handover's scheduler side as a state machine (hypothesis), over real KV managers of a
hybrid layout (two Gated DeltaNet groups, full attention, a sliding window), against a
shadow of what each side should hold.

Prefill side: prompts are computed (their blocks allocated) and held under leases that
are released or time out; the shadow is the set of live leases and their expiry; every
lease's offer names exactly the request's block table; once every lease is gone the pool
holds nothing.

Decode side: offers are admitted: the pull pairs each missing block of the prompt with
the offer's block at the same index of the same group, skips exactly the leading full
blocks the decode side's prefix cache holds (the shadow: blocks of prompts pulled whole
before, per group),
and moves every recurrent group's whole state; pulls end (ok or failed) in any order and
the counters agree with the shadow; once every pull has ended the pool holds nothing.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.engine.request import Request
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.recurrent import RecurrentStateAllocator
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill.kv_connector.handover.scheduler_side import HandoverScheduler
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.kv_handover import EngineEndpoint, HandoverReport, PullResult
from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 400  # no eviction: a cached block stays until the pool is reset
STATE = gated_delta_state_spec(24, 4, 2, 8, 4, torch.float32)
SPECS = [
    AttentionSpec(AttentionKind.LINEAR, 2, 1, 8, torch.float32, BLOCK, state=STATE),
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
    AttentionSpec(AttentionKind.LINEAR, 2, 1, 8, torch.float32, BLOCK, state=STATE),
    AttentionSpec(AttentionKind.SLIDING_WINDOW, 2, 1, 8, torch.float32, BLOCK, 6),
]
LAYOUT = plan_groups(SPECS)
PREFIXES = [[7] * 13, list(range(20)), [3, 1, 4, 1, 5, 9, 2, 6] * 2]
PEER = EngineEndpoint("prefill-x", "nixl", "m", "float32", BLOCK, "l", 1, [])
LEASE_S = 10.0
MAX_LIVE = 8  # leases (and pulls) at once: well within the pool


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HandoverMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.prefill_kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, LAYOUT.groups)
        self.decode_kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, LAYOUT.groups)
        self.prefill = HandoverScheduler("prefill-x", lease_s=LEASE_S)
        self.decode = HandoverScheduler("decode-y")
        self.now = 0.0
        self.ids = 0
        self.leases: dict[str, float] = {}  # shadow: lease id -> expiry
        self.offers: dict[str, object] = {}  # lease id -> offer (kept after the lease)
        self.pulling: dict[str, Request] = {}
        # (group, tokens up to the block's end) of every full block cached on decode
        self.cached: set[tuple[int, tuple[int, ...]]] = set()
        self.shadow = {"received": 0, "failed": 0, "skipped": 0, "pulled": 0}

    def _prompt(self, i: int, extra: int) -> list[int]:
        return PREFIXES[i] + [50 + i + k for k in range(extra)]

    # ---- prefill side ------------------------------------------------------------------
    @precondition(lambda self: len(self.leases) < MAX_LIVE)
    @rule(i=st.integers(0, 2), extra=st.integers(0, 6))
    def offer(self, i: int, extra: int) -> None:
        self.ids += 1
        prompt = self._prompt(i, extra)
        request = Request(f"p{self.ids}", prompt, SamplingParams(max_tokens=4))
        self.prefill_kv.update_block_hashes(request)
        assert self.prefill_kv.allocate_slots(request, len(prompt))
        request.num_computed_tokens = len(prompt)
        self.prefill_kv.cache_blocks(request, len(prompt))
        request.append_output_token(99)
        offer = self.prefill.hold(request, self.prefill_kv, None, now=self.now)
        assert offer.block_ids == self.prefill_kv.group_block_ids(request)
        assert offer.num_tokens == len(prompt) and offer.first_token == 99
        self.leases[offer.lease_id] = self.now + LEASE_S
        self.offers[offer.lease_id] = (offer, prompt)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        request = self.prefill.release(lease_id)
        assert request is not None and request.request_id == lease_id
        self.prefill_kv.free(request)
        del self.leases[lease_id]
        assert self.prefill.release(lease_id) is None  # a second release is a no-op

    @rule(dt=st.floats(0.5, 12.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        before = self.prefill.counters.lease_timeouts
        expired = self.prefill.expire(now=self.now)
        due = {lid for lid, t in self.leases.items() if t <= self.now}
        assert {r.request_id for r in expired} == due
        assert self.prefill.counters.lease_timeouts == before + len(due)
        for request in expired:
            self.prefill_kv.free(request)
            del self.leases[request.request_id]

    # ---- decode side -------------------------------------------------------------------
    @precondition(lambda self: self.offers and len(self.pulling) < MAX_LIVE)
    @rule(data=st.data())
    def admit(self, data) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.offers)))
        offer, prompt = self.offers[lease_id]
        self.ids += 1
        request = Request(f"d{self.ids}", prompt, SamplingParams(max_tokens=4),
                          handover_in=HandoverIn(offer, PEER))
        request.append_output_token(offer.first_token)
        self.decode.check(request)
        assert self.decode.admit(request, self.decode_kv)
        job = self.decode._pending[request.request_id].job
        skipped = self.decode._pending[request.request_id].skipped
        n = len(prompt)
        tables = self.decode_kv.group_block_ids(request)
        expected_pairs, expected_skipped = set(), 0
        for g, alloc in enumerate(self.decode_kv.allocators):
            if isinstance(alloc, RecurrentStateAllocator):  # the whole state, every page
                expected_pairs |= set(zip(offer.block_ids[g], tables[g], strict=True))
                continue
            hit = True  # the cache supplies a leading run of blocks: after a miss, none
            for j in range(alloc.first_needed_block(n), _cdiv(n, BLOCK)):
                full = (j + 1) * BLOCK <= n
                hit = hit and full and (g, tuple(prompt[: (j + 1) * BLOCK])) in self.cached
                if hit:
                    expected_skipped += 1
                else:
                    expected_pairs.add((offer.block_ids[g][j], tables[g][j]))
        assert set(job.pairs) == expected_pairs and len(job.pairs) == len(expected_pairs)
        assert skipped == expected_skipped
        self.pulling[request.request_id] = request
        assert self.decode.step_meta() is not None
        assert self.decode.is_pulling(request.request_id)

    @precondition(lambda self: self.pulling)
    @rule(data=st.data(), ok=st.booleans())
    def pull_ends(self, data, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.pulling)))
        pending = self.decode._pending[rid]
        report = HandoverReport(results=[PullResult(rid, ok, 64 * len(pending.job.pairs), 0.1)])
        [(request, result)] = self.decode.process(report)
        assert request.request_id == rid and result.ok == ok
        n = request.num_prompt_tokens
        if ok:
            self.shadow["received"] += 1
            self.shadow["pulled"] += len(pending.job.pairs)
            self.shadow["skipped"] += pending.skipped
            self.decode_kv.cache_blocks(request, n)
            for g, alloc in enumerate(self.decode_kv.allocators):
                if isinstance(alloc, RecurrentStateAllocator):
                    continue  # a window's blocks before it were never pulled: not cached
                for j in range(alloc.first_needed_block(n), n // BLOCK):
                    self.cached.add((g, tuple(request.prompt_token_ids[: (j + 1) * BLOCK])))
        else:
            self.shadow["failed"] += 1
        self.decode_kv.free(request)
        del self.pulling[rid]

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def counters_agree(self) -> None:
        stats = self.decode.stats()
        assert (stats.received, stats.failed, stats.blocks_pulled, stats.blocks_skipped) == (
            self.shadow["received"], self.shadow["failed"], self.shadow["pulled"],
            self.shadow["skipped"])
        assert self.prefill.num_leases == len(self.leases)
        assert self.decode.num_pulling == len(self.pulling)

    @invariant()
    def nothing_held_when_idle(self) -> None:
        if not self.leases:
            assert self.prefill_kv.blocks_in_use_per_group() == [0] * len(LAYOUT.groups)
        if not self.pulling:
            assert self.decode_kv.blocks_in_use_per_group() == [0] * len(LAYOUT.groups)


TestHandoverMachine = HandoverMachine.TestCase
TestHandoverMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                        deadline=None)
