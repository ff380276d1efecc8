"""Turns one step's logits into one token per request, with vLLM's sampling semantics.

Order of stages (each skipped when no row uses it): penalties -> logit_bias -> min_tokens -> greedy
argmax | temperature -> min_p -> top_k -> top_p -> draw. Logprobs are taken from the raw
logits, before any stage (vLLM's default "raw_logprobs"); for a request with structured
output the runner has already applied the grammar's mask to those logits.

A seeded request draws exactly one uniform number per step from its own generator and
picks its token by inverse CDF over its candidates in token-id order, so its tokens do
not depend on which other requests share the batch. Inverse CDF needs one random number
per row instead of one per vocabulary entry, which is what keeps 64 seeded rows cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tokenmill.platforms.step import Logprobs, SamplingSpec

# Rows with top_p but no top_k first look for their nucleus among this many top tokens and
# fall back to a full sort only when it holds less than top_p of the mass.
_TOP_P_PROBE = 256
# Column block of the two-level inverse CDF (see _inverse_cdf_blocked).
_BLOCK = 256


@dataclass(slots=True)
class SamplingRow:
    """One request to sample this step."""

    params: SamplingSpec  # read by field name only, so SamplingParams serves as well
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far, before this step
    generator: torch.Generator | None  # from make_generator(params.seed); None: global RNG


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[Logprobs | None]  # per row; None where params.logprobs is None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for `seed` on `device`; None when `seed` is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def replay_draws(generator: torch.Generator, num_draws: int) -> None:
    """Advance `generator` past `num_draws` sampling steps, exactly as `Sampler` draws
    (one float64 uniform per step of a random row): a request resumed after a preemption
    on a fresh generator then continues its random stream where it left off."""
    for _ in range(num_draws):
        torch.rand((), dtype=torch.float64, device=generator.device, generator=generator)


def sample_with_uniforms(
    logits: torch.Tensor, rows: list[SamplingRow], uniforms: torch.Tensor
) -> torch.Tensor:
    """The tokens `Sampler` draws for random rows of already penalised, biased and
    masked `logits` when its uniforms are `uniforms` (float64 [rows]): speculative
    decoding's verification draws the same tokens as decoding one at a time."""
    return _sample_random(logits, rows, uniforms)


class Sampler:
    """Stateless; one instance serves every step. Does not modify the logits it is given."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Samples one token per row from `logits` (float [len(rows), vocab])."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}; expected [len(rows)={len(rows)}, vocab]"
            )
        raw_logits = logits.float()
        logits = apply_penalties(raw_logits, rows)
        if logits is not raw_logits:
            # an extreme penalty (e.g. repetition_penalty=1e-300) overflows a logit to +inf,
            # and inf - inf is NaN in the softmax: keep penalised logits finite
            big = torch.finfo(logits.dtype).max
            logits.clamp_(min=-big, max=big)
        logits = apply_logit_bias(logits, rows, owned=logits is not raw_logits)
        logits = apply_min_tokens(logits, rows, owned=logits is not raw_logits)

        greedy_idx = [i for i, row in enumerate(rows) if row.params.greedy]
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_idx:
            token_ids = logits.argmax(-1)
        elif not greedy_idx:
            token_ids = _sample_random(logits, rows)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
            idx = _index(greedy_idx, logits.device)
            token_ids[idx] = logits[idx].argmax(-1)
            idx = _index(random_idx, logits.device)
            token_ids[idx] = _sample_random(logits[idx], [rows[i] for i in random_idx])

        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs: list[Logprobs | None] = [None] * len(rows)
        if wanted:
            idx = _index(wanted, logits.device)
            ks = [rows[i].params.logprobs for i in wanted]
            found = gather_logprobs(raw_logits[idx], token_ids[idx], ks)
            for i, lp in zip(wanted, found, strict=True):
                logprobs[i] = lp
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int] | torch.Tensor, k: int
) -> list[Logprobs]:
    """Logprobs of the prompt: `logits[i]` (float [n, vocab]) predicts `next_token_ids[i]`.

    Each entry holds the actual next token first, then the `k` most likely tokens.
    """
    ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    if ids.shape != logits.shape[:1]:
        raise ValueError(
            f"next_token_ids has {ids.shape[0]} ids for logits of shape {tuple(logits.shape)}"
        )
    return gather_logprobs(logits.float(), ids, [k] * ids.shape[0])


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[Logprobs]:
    """Per row: log_softmax(logits) at `token_ids[i]` with its rank, then the top `ks[i]`."""
    if len(ks) == 0:
        return []
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = torch.count_nonzero(logprobs > chosen, dim=-1) + 1
    max_k = min(max(ks), logprobs.shape[1])
    top = logprobs.topk(max_k, dim=-1) if max_k > 0 else None
    chosen_l, ids_l, ranks_l = chosen[:, 0].tolist(), token_ids.tolist(), ranks.tolist()
    top_values = top.values.tolist() if top is not None else [[]] * len(ks)
    top_ids = top.indices.tolist() if top is not None else [[]] * len(ks)
    return [
        Logprobs(
            token_ids=[ids_l[i], *top_ids[i][:k]],
            logprobs=[chosen_l[i], *top_values[i][:k]],
            ranks=[ranks_l[i], *range(1, min(k, max_k) + 1)],
        )
        for i, k in enumerate(ks)
    ]


# --- logits processors: each returns `logits` untouched or a new tensor -------------------


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (over prompt + output, HF/vLLM form), presence and frequency (over output,
    OpenAI form) penalties. Works on the penalised tokens only, never on a [rows, vocab]
    count table. Returns `logits` itself when no row has a penalty."""
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    freq = [
        i for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not rep and not freq:
        return logits
    vocab = logits.shape[1]
    out = logits.clone()
    flat = out.view(-1)
    if rep:
        pos = _flat_positions(
            [chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in rep],
            [len(rows[i].prompt_token_ids) + len(rows[i].output_token_ids) for i in rep],
            rep, vocab, out.device,
        ).unique()
        penalty = torch.tensor(
            [r.params.repetition_penalty for r in rows], dtype=out.dtype, device=out.device
        )[pos // vocab]
        values = flat[pos]
        flat[pos] = torch.where(values > 0, values / penalty, values * penalty)
    if freq:
        pos, counts = _flat_positions(
            [rows[i].output_token_ids for i in freq],
            [len(rows[i].output_token_ids) for i in freq],
            freq, vocab, out.device,
        ).unique(return_counts=True)
        row = pos // vocab
        frequency = torch.tensor(
            [r.params.frequency_penalty for r in rows], dtype=out.dtype, device=out.device
        )[row]
        presence = torch.tensor(
            [r.params.presence_penalty for r in rows], dtype=out.dtype, device=out.device
        )[row]
        flat[pos] -= frequency * counts.to(out.dtype) + presence
    return out


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
    """Adds each row's `logit_bias` to the biased tokens' logits (one scatter for the batch).

    Writes into `logits` only when `owned`; otherwise returns a biased copy if needed.
    Raises ValueError for a token id outside the vocabulary (the server refuses those
    before they reach the engine)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if bias:
            row_idx += [i] * len(bias)
            col_idx += bias.keys()
            values += bias.values()
    if not row_idx:
        return logits
    vocab = logits.shape[1]
    bad = [t for t in col_idx if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary of {vocab}")
    if not owned:
        logits = logits.clone()
    flat = _index(row_idx, logits.device) * vocab + _index(col_idx, logits.device)
    logits.view(-1).index_add_(0, flat, torch.tensor(values, dtype=logits.dtype, device=logits.device))
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
    """Masks the stop and eos tokens of rows that have fewer than min_tokens outputs.

    Writes into `logits` only when `owned`; otherwise returns a masked copy if needed."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
        row_idx += [i] * len(banned)
        col_idx += banned
    if not row_idx:
        return logits
    vocab = logits.shape[1]
    bad = [t for t in col_idx if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop/eos token id {bad[0]} is outside the vocabulary of {vocab}")
    if not owned:
        logits = logits.clone()
    logits[_index(row_idx, logits.device), _index(col_idx, logits.device)] = float("-inf")
    return logits


# --- random sampling ----------------------------------------------------------------------


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then one inverse-CDF draw per row (`uniforms`:
    float64 [rows] given by the caller; None: drawn here, one per row)."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device)
    logits = logits / temperature[:, None]
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
        floor = logits.amax(-1, keepdim=True) + torch.tensor(min_p, device=device).log()[:, None]
        logits = torch.where(logits < floor, float("-inf"), logits)
    if uniforms is None:
        uniforms = _uniforms(rows, device)

    vocab = logits.shape[1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    truncated = [i for i in range(len(rows)) if top_k[i] < vocab or top_p[i] < 1.0]
    if not truncated:
        return _inverse_cdf_blocked(logits, uniforms)
    plain = [i for i in range(len(rows)) if top_k[i] == vocab and top_p[i] == 1.0]
    token_ids = torch.empty(len(rows), dtype=torch.int64, device=device)
    if plain:
        idx = _index(plain, device)
        token_ids[idx] = _inverse_cdf_blocked(logits[idx], uniforms[idx])
    idx = _index(truncated, device)
    token_ids[idx] = _sample_top_k_top_p(
        logits[idx] if plain else logits,
        [top_k[i] for i in truncated], [top_p[i] for i in truncated], uniforms[idx],
        probe=_TOP_P_PROBE,
    )
    return token_ids


def _sample_top_k_top_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], uniforms: torch.Tensor,
    probe: int,
) -> torch.Tensor:
    """Draws among each row's top_k tokens, then the smallest set holding top_p of their
    renormalised mass (vLLM order). `top_k[i] == vocab` means no top-k.

    Needs only the top max(top_k) tokens (or `probe` for top_p-only rows); rows whose
    nucleus is larger than `probe` are redone with a full sort.
    """
    device, vocab = logits.device, logits.shape[1]
    has_k = [k < vocab for k in top_k]
    width = max(k for k in top_k if k < vocab) if any(has_k) else 0
    if not all(has_k):
        width = max(width, probe)
    width = min(width, vocab)
    if width < vocab:
        values, ids = logits.topk(width, dim=-1)
    else:
        values, ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(width, device=device)
    values = values.masked_fill(rank >= torch.tensor(top_k, device=device)[:, None], float("-inf"))

    uncovered: list[int] = []
    if any(p < 1.0 for p in top_p):
        # Without top-k the nucleus is measured against the whole vocabulary's mass. float64
        # keeps the cut-off from depending, by rounding, on `width`.
        log_mass = values.double().logsumexp(-1)
        no_k = [i for i, h in enumerate(has_k) if not h]
        if no_k:
            idx = _index(no_k, device)
            log_mass[idx] = logits[idx].logsumexp(-1).double()
        probs = _exp(values - log_mass[:, None].float())
        cumulative = probs.cumsum(-1, dtype=torch.float64)
        probs = probs.double()
        # p == 1 must keep everything, even where the summed mass creeps past 1.
        p = torch.tensor([q if q < 1.0 else 2.0 for q in top_p], dtype=torch.float64, device=device)
        p = p[:, None]
        values = values.masked_fill(cumulative - probs >= p, float("-inf"))
        if width < vocab:
            short = (cumulative[:, -1] < p[:, 0]).tolist()
            uncovered = [i for i in no_k if short[i]]

    # Draw in token-id order, so the pick depends neither on `width` (hence on the other
    # rows in the batch) nor on how topk orders ties.
    ids, order = ids.sort(dim=-1)
    token_ids = ids.gather(1, _inverse_cdf(values.gather(1, order), uniforms)[:, None])[:, 0]
    if uncovered:
        idx = _index(uncovered, device)
        token_ids[idx] = _sample_top_k_top_p(
            logits[idx], [vocab] * len(uncovered), [top_p[i] for i in uncovered],
            uniforms[idx], probe=vocab,
        )
    return token_ids


def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Column drawn from softmax(logits) per row, using `uniforms` (float64 [rows]).

    -inf columns are never drawn. The float64 cumulative sum runs column by column, so
    -inf columns (exact zeros) inserted anywhere leave every other column's draw unchanged.
    """
    weights = _exp(logits - logits.amax(-1, keepdim=True))
    cumulative = weights.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cumulative, _target(cumulative, uniforms), right=True)[:, 0]


def _inverse_cdf_blocked(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_inverse_cdf for whole-vocabulary rows, about 2x cheaper: cumulative mass over blocks
    of _BLOCK columns finds the block, a cumulative sum over that one block the column."""
    num_rows, width = logits.shape
    block_size = min(width, _BLOCK)
    weights = _exp(logits - logits.amax(-1, keepdim=True))
    if width % block_size:
        weights = torch.nn.functional.pad(weights, (0, block_size - width % block_size))
    blocks = weights.view(num_rows, -1, block_size)
    block_mass = blocks.sum(-1).double()
    cumulative = block_mass.cumsum(-1)
    target = _target(cumulative, uniforms)
    block = torch.searchsorted(cumulative, target, right=True)
    before = (cumulative - block_mass).gather(1, block)
    rows = torch.arange(num_rows, device=logits.device)
    inside = before + blocks[rows, block[:, 0]].cumsum(-1, dtype=torch.float64)
    # The block's own sum rounds differently from its cumulative sum: clamp the target into
    # the block's span so the column found is one whose weight is > 0.
    target = torch.minimum(torch.maximum(target, before), _below(inside[:, -1:]))
    column = torch.searchsorted(inside, target, right=True).clamp_(max=block_size - 1)
    return (block * block_size + column)[:, 0]


def _target(cumulative: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """u * total mass, kept below the total (u * total can round up to it) so that the
    first cumulative entry above the target always exists and has a weight > 0."""
    total = cumulative[:, -1:]
    return torch.minimum(uniforms[:, None] * total, _below(total))


def _below(x: torch.Tensor) -> torch.Tensor:
    return x.nextafter(torch.zeros_like(x))


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp, in place, of x <= 0 with results below 1e-37 (and exp(-inf)) flushed to exactly 0.

    CPU exp takes a slow path, ~10x, for arguments that underflow, which low temperatures
    and masked (-inf) logits make common; clamping first keeps it on the fast path."""
    return torch.nn.functional.threshold_(x.clamp_(min=-87.0).exp_(), 1e-37, 0.0)


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: from the row's generator when it has one, the
    global RNG (one batched draw) otherwise."""
    uniforms = torch.empty(len(rows), dtype=torch.float64, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        uniforms[_index(unseeded, device)] = torch.rand(
            len(unseeded), dtype=torch.float64, device=device
        )
    for i, r in enumerate(rows):
        if r.generator is not None:
            uniforms[i] = torch.rand(
                (), dtype=torch.float64, device=r.generator.device, generator=r.generator
            ).to(device)
    return uniforms


def _flat_positions(
    id_lists: list, lengths: list[int], row_ids: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """row * vocab + token_id for every token of every listed row, as one int64 tensor."""
    ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int64, count=sum(lengths))
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0]
        raise ValueError(f"token id {bad} is outside the vocabulary of {vocab}")
    rows = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    return torch.from_numpy(rows * vocab + ids).to(device)


def _index(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.int64, device=device)
