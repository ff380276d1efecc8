"""The engine's part of prefill/decode disaggregation: its endpoint (what peers reach and
check), the first token of a handed-over request, lease releases and the counters.

An engine takes part when `kv_role` is prefill or decode, or `kv_transport` is set: each
of its ranks then registers its KV arena with the transport (worker_side.py) and the
scheduler gets a `HandoverScheduler` (scheduler_side.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

import msgspec

from tokenmill.frontend.outputs import EngineCoreOutput
from tokenmill.kv_connector.handover.messages import HandoverIn, HandoverOffer, HandoverStats
from tokenmill.kv_connector.handover.scheduler_side import HandoverScheduler
from tokenmill.kv_connector.handover.transports import resolve_transport_name
from tokenmill.platforms.kv_handover import EngineEndpoint, RankEndpoint, compatibility_problems

logger = logging.getLogger(__name__)


def handover_transport(args) -> str | None:
    """The KV transport EngineArgs ask for (None: no disaggregation)."""
    if args.kv_transport is None and args.kv_role == "both":
        return None
    if args.data_parallel_size > 1:
        raise ValueError("prefill/decode disaggregation runs one engine per instance: start "
                         f"several instances instead of data_parallel_size={args.data_parallel_size}")
    if args.pipeline_parallel_size > 1 or args.decode_context_parallel_size > 1 or (
            args.prefill_context_parallel_size > 1):
        raise ValueError("prefill/decode disaggregation runs with tensor parallel only: "
                         "pipeline and context parallel engines cannot hand over KV yet")
    if not args.enable_prefix_caching:
        raise ValueError("prefill/decode disaggregation keys blocks by the prefix cache; it "
                         "needs enable_prefix_caching=True")
    return resolve_transport_name(args.kv_transport)


def new_engine_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


def check_sequences(n: int, handover_out: bool, handover_in: HandoverIn | None) -> None:
    """A handed-over request has one sequence: ValueError naming `n` otherwise."""
    if (handover_out or handover_in is not None) and n != 1:
        raise ValueError(f"a handed-over request has one sequence; this one asks n={n}")


def check_admission(handover: EngineHandover | None, request) -> None:
    """Raise ValueError naming the problem if `request` (an engine `Request`) asks for a
    handover this engine cannot do: it takes no part in P/D, or the peer or prompt
    do not match."""
    if (request.handover_out or request.handover_in) and handover is None:
        raise ValueError("this engine hands no KV over: start it with --kv-role "
                         "prefill|decode or --kv-transport")
    if request.handover_in is not None:
        handover.check(request)


def to_scheduler(handover: EngineHandover | None, request) -> bool:
    """Whether an admitted, checked `request` goes to the scheduler: a handed-over one
    emits its first token now and is scheduled only if that token did not end it."""
    return request.handover_in is None or handover.accept(request)


def model_digest(hf_config) -> str:
    """The model's identity for a handover: its config, wherever it was loaded from."""
    config = hf_config.to_dict()
    config.pop("_name_or_path", None)
    text = json.dumps(config, sort_keys=True, default=str)  # id2label's keys are ints
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layout_digest(groups, ranks: list[RankEndpoint]) -> str:
    """The KV layout's identity whatever the tensor parallel size: groups (kind, window,
    layers), slots, and how each group's pages split (`PageShard` less this rank's part:
    the model's heads, their bytes, the rows). What is laid out per tp size (recurrent
    states, page bytes) is left out: it follows from the model and the tp size, both
    checked on their own."""
    described = [(g.kind.value, g.sliding_window, len(g.layers)) for g in groups]
    first = ranks[0]
    pages = (first.geometry.num_slots, first.geometry.halves,
             [(s.kind, s.rows, s.head_bytes, s.total_heads) for s in first.shards])
    return hashlib.sha256(repr((described, pages)).encode()).hexdigest()[:16]


class EngineHandover:
    """`engine`: the LLMEngine (its executor, KV groups, scheduler and output processor)."""

    def __init__(self, engine, transport: str, engine_id: str) -> None:
        args = engine.args
        self.engine = engine
        self.transport = transport
        self.engine_id = engine_id
        self.role = args.kv_role
        self.scheduler_side = HandoverScheduler(engine_id, args.kv_lease_s,
                                                args.kv_pull_timeout_s)
        engine.scheduler.handover = self.scheduler_side
        self._deltas: list[EngineCoreOutput] = []  # first tokens, sent with the next step
        self._endpoint: EngineEndpoint | None = None
        logger.info("prefill/decode disaggregation: role %s, engine %s, transport %s",
                    self.role, engine_id, transport)

    def endpoint(self) -> EngineEndpoint:
        """How peers reach this engine's KV arena, and what they must match."""
        if self._endpoint is None:
            engine = self.engine
            ranks = [msgspec.msgpack.decode(b, type=RankEndpoint)
                     for b in engine.executor.collective_rpc("handover_endpoint")]
            self._endpoint = EngineEndpoint(
                engine_id=self.engine_id, transport=self.transport,
                model=model_digest(engine.loaded.hf_config),
                dtype=str(engine.dtype).removeprefix("torch."), block_size=engine.args.block_size,
                kv_cache_dtype=engine.config.kv_cache_dtype or engine.config.dtype,
                kv_scales=scales_digest(engine.executor.collective_rpc("kv_scales_digest")),
                layout=layout_digest(engine.kv.groups, ranks),
                tensor_parallel_size=engine.args.tensor_parallel_size, ranks=ranks,
            )
        return self._endpoint

    def check_peer(self, peer: EngineEndpoint) -> None:
        """Raise ValueError naming every mismatch between `peer` and this engine."""
        problems = compatibility_problems(self.endpoint(), peer)
        if problems:
            raise ValueError(f"engine {peer.engine_id} cannot hand its KV over to "
                             f"{self.engine_id}: " + "; ".join(problems))

    def check(self, request) -> None:
        """Raise ValueError naming the problem if `request`'s handover cannot apply here
        (an incompatible peer, another prompt)."""
        self.check_peer(request.handover_in.peer)
        self.scheduler_side.check(request)

    def accept(self, request) -> bool:
        """A checked handed-over request arrives: emit its first token (the prefill
        engine's) at once. False: that token ended it (nothing to pull). A prefix offer
        has no first token: the request computes the rest of its prompt once pulled."""
        if request.handover_in.offer.prefix:
            return True
        delta = self.engine.core_outputs.first_token(request)
        finished = delta.finish_reason is not None
        delta.kv_pulled = finished  # nothing will be pulled: its lease can go now
        self._deltas.append(delta)
        return not finished

    def after_step(self, report, deltas: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Apply the workers' pull report; the step's deltas with the first tokens of
        requests that arrived since, and `kv_pulled` on those whose pull ended."""
        ended = set(self.engine.scheduler.update_from_handover(report))
        out = self.take_deltas() + deltas
        for delta in out:
            if delta.request_id in ended:
                delta.kv_pulled = True
                ended.discard(delta.request_id)
        out += [EngineCoreOutput(rid, kv_pulled=True) for rid in ended]
        return out

    def take_deltas(self) -> list[EngineCoreOutput]:
        out, self._deltas = self._deltas, []
        return out

    def busy(self) -> bool:
        """Whether deltas wait to be sent; frees the KV of expired leases first."""
        self.engine.scheduler.expire_handovers()
        return bool(self._deltas)

    def offer_prefix(self, lease_id: str, token_ids: list[int],
                     cache_salt: str | None = None) -> HandoverOffer | None:
        """Lease the longest prefix of `token_ids` this engine's prefix cache holds, for
        the prefill engine of a conversation's next turn to pull (None: nothing cached)."""
        return self.engine.scheduler.lease_prefix(lease_id, token_ids, cache_salt)

    def lease(self, request) -> None:
        """A `lease_prefix` request (an `EngineCoreRequest`): lease the longest cached
        prefix of its prompt; its one delta, finished, carries the offer as `kv_offer`
        (None: nothing cached) and goes with the next step."""
        offer = self.offer_prefix(request.request_id, request.prompt_token_ids,
                                  request.cache_salt)
        self._deltas.append(EngineCoreOutput(request.request_id, finish_reason="length",
                                             kv_offer=offer))

    def release(self, lease_ids: list[str]) -> int:
        """Decode engines are done with these leases; returns how many were held."""
        return sum(self.engine.scheduler.release_handover(lid) for lid in lease_ids)

    def stats(self) -> HandoverStats:
        return self.scheduler_side.stats()


def scales_digest(rank_digests: list[str]) -> str:
    """One digest of every rank's calibrated KV scales, in rank order ("" when no rank
    calibrated: the scales are the checkpoint's or 1.0, which the model fixes)."""
    if not any(rank_digests):
        return ""
    return hashlib.sha256("/".join(rank_digests).encode()).hexdigest()[:16]
