"""What prefill/decode disaggregation passes between engines and to the frontend
(msgspec Structs: offers cross HTTP between instances as msgpack). The step's part (pull
jobs and reports) and the endpoints are in `tokenmill.platforms.kv_handover`.

- `HandoverOffer`: what a prefill engine holds under a lease once it computed a request's
  prompt and sampled its first token (`GET /v1/pd/lease/{id}`).
- `HandoverIn`: a decode request's handover: the offer and its prefill engine's endpoint.
- `HandoverStats`: an engine's handover counters (/metrics).
"""

from __future__ import annotations

import hashlib

import msgspec

from tokenmill.platforms.kv_handover import EngineEndpoint
from tokenmill.platforms.step import Logprobs


class HandoverOffer(msgspec.Struct, frozen=True):
    """A prefill engine's computed prompt, held under a lease until the decode side
    releases it (or the lease times out)."""

    lease_id: str  # the prefill engine's request id
    engine_id: str
    num_tokens: int  # prompt tokens whose KV (and recurrent state after them) is held
    prompt_digest: str  # `prompt_digest(prompt ids)`: the decode side's prompt must match
    # per KV group: the request's block table (a recurrent group's: its state slot, which
    # holds the state after exactly `num_tokens` tokens)
    block_ids: list[list[int]]
    first_token: int  # sampled by the prefill engine from the prompt's last logits
    first_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0  # the prefill engine's prefix-cache hit (reported as cached)
    # a cached prefix of the prompt only (an agent's next turn pulling turn N's KV back
    # from the decode engine that holds it): `num_tokens` is a block boundary short of the
    # prompt, there is no first token (-1), and the request computes the rest itself
    prefix: bool = False


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(token_ids)).hexdigest()


class HandoverIn(msgspec.Struct, frozen=True):
    """A decode request's handover: pull `offer` from the engine at `peer`."""

    offer: HandoverOffer
    peer: EngineEndpoint


class HandoverStats(msgspec.Struct, frozen=True):
    """Counters of an engine's handovers, monotonic (/metrics)."""

    offered: int = 0  # prompts computed and held for a decode engine (prefill side)
    received: int = 0  # handovers pulled in whole (decode side)
    failed: int = 0  # pulls that failed or timed out (recomputed instead)
    bytes_moved: int = 0  # bytes of the pulled blocks' pages (decode side)
    transport_bytes: int = 0  # bytes the transports counted as read (decode side)
    blocks_pulled: int = 0
    blocks_skipped: int = 0  # blocks the decode side's prefix cache already held
    lease_timeouts: int = 0  # leases that expired before a release (prefill side)
    leases_held: int = 0  # now
    transfer_seconds: float = 0.0  # summed over pulls
