"""The plugin's sampler: greedy and temperature / min-p / top-k / top-p sampling in JAX.

Greedy rows take the argmax of the same logits the reference platform's sampler sees, so
greedy tokens match it (conformance T3). Random rows draw with JAX's counter-based RNG:
a seeded request's key is `fold_in(PRNGKey(seed), number of tokens generated so far)`, so
its tokens do not depend on its batch-mates and survive preemption; they are not the
tokens torch's generator would draw for the same seed (the core's sampler uses torch's
RNG), and no test claims they are.

Rows that need what this sampler does not implement (repetition / presence / frequency
penalties, logit_bias, min_tokens still masking stop tokens, logprobs, a structured-output mask) go
to the core's torch `Sampler` on host copies of their logits, with an INFO log line once
per reason; `JaxSampler.num_fallback_rows` counts them so tests can check the fast path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill.platforms.kit.runner_state import RequestState
from tokenmill.platforms.step import SamplingSpec

logger = logging.getLogger(__name__)


def fallback_reason(spec: SamplingSpec, state: RequestState) -> str | None:
    """Why this row needs the core's sampler, or None when the JAX sampler covers it."""
    if spec.logprobs is not None:
        return "logprobs"
    if spec.logit_bias:
        return "logit_bias"
    if (spec.repetition_penalty, spec.presence_penalty, spec.frequency_penalty) != (1.0, 0.0, 0.0):
        return "penalties"
    masked = spec.stop_token_ids or (spec.eos_token_ids and not spec.ignore_eos)
    if spec.min_tokens and masked and len(state.output_token_ids) < spec.min_tokens:
        return "min_tokens"
    return None


@jax.jit
def _sample(logits, greedy, temperature, min_p, top_k, top_p, keys):
    """One token per row: argmax where `greedy`, else a draw from the filtered softmax."""
    argmax = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-5)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_probs = jnp.take_along_axis(jnp.where(keep, probs, 0.0), order, axis=-1)
    rank = jnp.arange(logits.shape[1])[None]
    in_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_probs = jnp.where(in_k, sorted_probs, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(axis=-1, keepdims=True)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass ranked above each token
    sorted_probs = jnp.where(before < top_p[:, None], sorted_probs, 0.0)
    choice = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, sorted_probs)
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(greedy, argmax, drawn)


@dataclass(slots=True)
class JaxSampler:
    """Samples the rows the JAX path covers; see the module docstring for the others."""

    seed: int = 0
    num_fallback_rows: int = 0

    def sample(self, logits: jax.Array, states: list[RequestState], step_id: int) -> list[int]:
        """Token ids for the first len(states) rows of `logits` (rows past are padding)."""
        rows = logits.shape[0]
        pad = rows - len(states)
        specs = [s.sampling for s in states]
        greedy = np.array([sp.greedy for sp in specs] + [True] * pad)
        if greedy.all():
            return np.asarray(jnp.argmax(logits, axis=-1))[: len(states)].tolist()
        keys = np.stack([self._key(s, step_id, i) for i, s in enumerate(states)]
                        + [self._key(None, step_id, rows + i) for i in range(pad)])

        def column(name: str, fill: float) -> np.ndarray:
            return np.array([getattr(sp, name) for sp in specs] + [fill] * pad, np.float32)

        ids = _sample(
            logits, greedy, column("temperature", 1.0), column("min_p", 0.0),
            column("top_k", 0).astype(np.int32), column("top_p", 1.0), keys,
        )
        return np.asarray(ids)[: len(states)].tolist()

    def _key(self, state: RequestState | None, step_id: int, row: int) -> np.ndarray:
        # a seeded request's generator carries its seed (tokenmill.platforms.kit.runner_state)
        seed = None if state is None or state.generator is None else state.generator.initial_seed()
        if seed is not None:
            # PRNGKey takes 32 bits without x64; a seed's low 32 bits name its stream
            key = jax.random.PRNGKey(seed & 0xFFFFFFFF)
            key = jax.random.fold_in(key, len(state.output_token_ids))
        else:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), step_id), row)
        return np.asarray(key)
