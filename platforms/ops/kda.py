"""Pure-PyTorch references of Kimi Delta Attention (KDA, Kimi Linear): the gated delta
rule with a per-channel decay. A chunked scan for prefill, the token recurrence for
decode; one sequence at a time, float32 math, the same shapes and conventions as
`tokenmill.platforms.ops.gated_delta` (whose causal conv KDA also puts in front).

Per head, with state S [dk, dv], l2-normalised q and k, q scaled by dk ** -0.5, a log
decay per key channel g_t [dk] (<= 0) and a learning rate beta_t in (0, 1):

    S  <- diag(exp(g_t)) S
    S  <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

Gated DeltaNet is the case where every channel of a head decays alike. The chunked form
keeps, within a chunk, the cumulative per-channel decay gamma [c, dk] and the decay
between two positions of the chunk exp(gamma_i - gamma_j) per channel (materialised
pairwise, [c, c, dk], rather than as exp(gamma_i) * exp(-gamma_j): the second factor
overflows on fast-decaying channels); only the state crosses chunk boundaries.
"""

from __future__ import annotations

import torch

from tokenmill.platforms.ops.gated_delta import _initial, _prepare


def _check(key: torch.Tensor, g: torch.Tensor) -> None:
    if g.dim() != 3 or g.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"KDA's decay g is per key channel, [T, H, dk] = [T, H, {key.shape[-1]}]; got "
            f"{tuple(g.shape)}"
        )


def kda_recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (decode; also the oracle of the chunked scan).

    Shapes: query/key [T, Hk, dk], value [T, Hv, dv] (Hv a multiple of Hk), g float32
    [T, Hv, dk] (log decay per key channel), beta [T, Hv], initial_state float32
    [Hv, dk, dv] (None: zeros). Returns (output [T, Hv, dv] in value's dtype, the final
    state float32 [Hv, dk, dv]). Does not modify its inputs.
    """
    _check(key, g)
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    state = _initial(initial_state, v.shape[0], k.shape[-1], v.shape[-1], v.device)
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, :, None]  # each key channel (row of S) decays
        predicted = torch.einsum("hkv,hk->hv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
    return out.transpose(0, 1).to(value.dtype), state


def kda_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `kda_recurrent`, `chunk_size` tokens per sequential step (prefill).
    Same shapes and contract."""
    _check(key, g)
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    num_heads, length, dk = k.shape
    state = _initial(initial_state, num_heads, dk, v.shape[-1], v.device)
    out = torch.empty_like(v)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        c = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]
        gamma = g[:, start:end].cumsum(dim=1)  # [H, c, dk]: log decay from the chunk start
        # per-channel decay from position j to i (j <= i): [H, c, c, dk]
        pair = (gamma[:, :, None, :] - gamma[:, None, :, :]).masked_fill(
            ~causal[:c, :c, None], float("-inf")
        ).exp()
        # UT transform: (I + A) [u | w] = beta * [v | k exp(gamma)], A strictly lower
        a = torch.einsum("hid,hjd,hijd->hij", bc * kc, kc, pair).tril(-1)
        rhs = torch.cat((bc * vc, bc * kc * gamma.exp()), dim=-1)
        solved = torch.linalg.solve_triangular(
            a + torch.eye(c, device=v.device), rhs, upper=False, unitriangular=True
        )
        u, w = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]
        v_new = u - w @ state  # the part of each value the carried state does not predict
        intra = torch.einsum("hid,hjd,hijd->hij", qc, kc, pair)  # causal via pair's zeros
        out[:, start:end] = (qc * gamma.exp()) @ state + intra @ v_new
        last = gamma[:, -1:, :]  # [H, 1, dk]
        state = state * last[:, 0, :, None].exp() + (kc * (last - gamma).exp()).transpose(
            -1, -2
        ) @ v_new
    return out.transpose(0, 1).to(value.dtype), state
