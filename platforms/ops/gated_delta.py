"""Pure-PyTorch references of Gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi's KDA family):
a chunked scan for prefill, the token recurrence for decode, and the causal depthwise
convolution in front of them. One sequence at a time; float32 math.

The recurrence, per head, with state S [dk, dv], l2-normalised q and k, q scaled by
dk ** -0.5, decay g_t <= 0 (log space) and learning rate beta_t in (0, 1):

    S  <- exp(g_t) * S
    S  <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule)
    o_t = S^T q_t

The chunked form computes the same thing C tokens at a time: within a chunk the delta
updates are condensed by a unit-lower-triangular solve (the UT transform), and only the
state crosses chunk boundaries, so a prefill of T tokens costs T / C sequential steps of
matmuls. Splitting a sequence anywhere and carrying the state gives the same result,
which is what chunked prefill and prefix-cache checkpoints rely on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(query, key, value, g, beta, use_qk_l2norm):
    """float32, heads first ([H, T, D]); q/k repeated onto the value heads; q scaled."""
    num_k_heads, num_v_heads = key.shape[1], value.shape[1]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
    if num_v_heads != num_k_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v = (t.float().transpose(0, 1) for t in (query, key, value))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.float().transpose(0, 1), beta.float().transpose(0, 1)


def _initial(state, num_heads, dk, dv, device):
    if state is None:
        return torch.zeros(num_heads, dk, dv, dtype=torch.float32, device=device)
    return state.float().clone()


def gated_delta_rule_recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (decode; also the oracle of the chunked scan).

    Shapes: query/key [T, Hk, dk], value [T, Hv, dv] (Hv a multiple of Hk: each key head
    serves Hv / Hk consecutive value heads), g and beta [T, Hv], initial_state float32
    [Hv, dk, dv] (None: zeros). Returns (output [T, Hv, dv] in value's dtype, the final
    state float32 [Hv, dk, dv]). Does not modify its inputs.
    """
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm)
    state = _initial(initial_state, v.shape[0], k.shape[-1], v.shape[-1], v.device)
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
    return out.transpose(0, 1).to(value.dtype), state


def gated_delta_rule_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `gated_delta_rule_recurrent`, `chunk_size` tokens per sequential step
    (prefill). Same shapes and contract."""
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
        gamma = g[:, start:end].cumsum(dim=-1)  # log decay from the chunk start, [H, c]
        # decay between positions j <= i of the chunk: exp(gamma_i - gamma_j)
        pair = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal[:c, :c], float("-inf"))
        pair = pair.exp()
        # UT transform: (I + A) [u | w] = beta * [v | k exp(gamma)], A strictly lower
        a = ((bc * kc) @ kc.transpose(-1, -2)) * pair
        rhs = torch.cat((bc * vc, bc * kc * gamma.exp()[..., None]), dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u, w = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]
        v_new = u - w @ state  # the part of each value the carried state does not predict
        intra = (qc @ kc.transpose(-1, -2)) * pair
        out[:, start:end] = (qc * gamma.exp()[..., None]) @ state + intra @ v_new
        last = gamma[:, -1:]
        state = state * last.exp()[..., None] + (kc * (last - gamma).exp()[..., None]).transpose(
            -1, -2
        ) @ v_new
    return out.transpose(0, 1).to(value.dtype), state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over one sequence's new tokens.

    Shapes: x [T, C] (the new tokens), weight [C, K], state [C, K - 1] (the K - 1 inputs
    before x; None: zeros, a fresh sequence), bias [C]. Returns (output [T, C] in x's
    dtype, the new state [C, K - 1]: the last K - 1 inputs). `activation`: "silu" or
    None. Does not modify its inputs.
    """
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    padded = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=-1)  # [C, K - 1 + T]
    y = F.conv1d(padded[None].to(weight.dtype), weight[:, None, :], bias, groups=channels)[0]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation {activation!r} is not one of ('silu', None)")
    return y.transpose(0, 1).to(x.dtype), padded[:, -(width - 1) :].clone()
