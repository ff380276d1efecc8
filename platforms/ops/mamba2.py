"""Pure-PyTorch references of the Mamba2 mixer's state-space ops (Bamba, Nemotron-H,
Falcon-H1, Granite 4 hybrids): the SSD chunked scan for prefill, the single-token
recurrence for decode, and the gated RMSNorm after them. The causal depthwise convolution
in front of the scan is `tokenmill.platforms.ops.gated_delta.causal_conv1d` (the same op). One
sequence at a time for the scans, float32 math.

The recurrence, per head h with state S [P, N] (P the head dim, N the state size), a
scalar negative A_h, a step dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit) and the
head's group g(h) of B and C:

    S   <- exp(dt_t A_h) * S + dt_t * x_t B_t^T
    y_t  = S C_t + D_h * x_t

The chunked form (SSD) computes the same thing `chunk_size` tokens at a time: inside a
chunk the output is a causally masked, decay-weighted (C B^T) x, plus the carried state
read out through C; only the state crosses chunk boundaries. Splitting a sequence anywhere
and carrying the state gives the same result, which is what chunked prefill and
prefix-cache checkpoints rely on; `boundaries` makes a chunk end at each given offset so
the states there come out exact, at no extra cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import AttentionSpec, RecurrentStateSpec, StateTensorSpec
from tokenmill.platforms.ops.gated_delta import causal_conv1d


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float] = (0.0, float("inf"))
) -> torch.Tensor:
    """The step size per token and head: clamp(softplus(dt + dt_bias), *dt_limit), float32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N] float32: each group serves H / G consecutive heads."""
    groups = t.shape[-2]
    if num_heads % groups:
        raise ValueError(f"{num_heads} heads are not a multiple of {groups} B/C groups")
    return t.float().repeat_interleave(num_heads // groups, dim=-2)


def _initial(state: torch.Tensor | None, h: int, p: int, n: int, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(h, p, n, dtype=torch.float32, device=device)
    return state.float().clone()


def _chunk_ends(length: int, chunk_size: int, boundaries: Sequence[int]) -> list[int]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bad = [b for b in boundaries if not 0 < b <= length]
    if bad:
        raise ValueError(f"boundaries {bad} are not within (0, {length}]")
    return sorted({*range(chunk_size, length, chunk_size), *boundaries, length})


def mamba2_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    boundaries: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SSD scan of one sequence's new tokens (prefill).

    Shapes: x [T, H, P], dt [T, H] already discretized (`discretize_dt`), A [H] (negative),
    B and C [T, G, N] (H a multiple of G), D [H] or None, initial_state [H, P, N] (None:
    zeros, a fresh sequence). `boundaries`: token offsets in (0, T] at which to also
    return the state (block boundaries, for prefix-cache checkpoints).

    Returns (y [T, H, P] in x's dtype, the final state float32 [H, P, N], the states after
    each of `boundaries` float32 [len(boundaries), H, P, N], in the order given). Does
    not modify its inputs.
    """
    length, num_heads, head_dim = x.shape
    xf = x.float().transpose(0, 1)  # [H, T, P]
    Bh = _heads(B, num_heads).transpose(0, 1)  # [H, T, N]
    Ch = _heads(C, num_heads).transpose(0, 1)
    dtf = dt.float().transpose(0, 1)  # [H, T]
    log_decay = dtf * A.float()[:, None]  # [H, T], <= 0
    state = _initial(initial_state, num_heads, head_dim, B.shape[-1], x.device)
    out = torch.empty_like(xf)
    saved: dict[int, torch.Tensor] = {}
    start = 0
    for end in _chunk_ends(length, chunk_size, boundaries):
        c = end - start
        xc, bc, cc = xf[:, start:end], Bh[:, start:end], Ch[:, start:end]
        dxc = xc * dtf[:, start:end, None]  # dt_j x_j
        gamma = log_decay[:, start:end].cumsum(dim=-1)  # log decay from the chunk start
        causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        pair = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        scores = (cc @ bc.transpose(-1, -2)) * pair  # [H, c, c]: C_i . B_j decayed j -> i
        out[:, start:end] = scores @ dxc + (cc @ state.transpose(-1, -2)) * gamma.exp()[..., None]
        to_end = (gamma[:, -1:] - gamma).exp()  # decay from each token to the chunk end
        state = state * gamma[:, -1, None, None].exp() + (dxc * to_end[..., None]).transpose(
            -1, -2
        ) @ bc
        saved[end] = state
        start = end
    if D is not None:
        out = out + D.float()[:, None, None] * xf
    boundary_states = (
        torch.stack([saved[b] for b in boundaries])
        if boundaries
        else state.new_zeros(0, *state.shape)
    )
    return out.transpose(0, 1).to(x.dtype), state, boundary_states


def mamba2_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences (decode), batched.

    Shapes: state [S, H, P, N], x [S, H, P], dt [S, H] discretized, A [H], B and C
    [S, G, N], D [H] or None. Returns (y [S, H, P] in x's dtype, the new state float32
    [S, H, P, N]). Does not modify its inputs.
    """
    num_heads = x.shape[1]
    dtf = dt.float()
    decay = (dtf * A.float()).exp()[..., None, None]  # [S, H, 1, 1]
    xf = x.float()
    bh, ch = _heads(B, num_heads), _heads(C, num_heads)  # [S, H, N]
    new = state.float() * decay + (xf * dtf[..., None])[..., None] * bh[:, :, None, :]
    y = (new @ ch[..., None])[..., 0]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), new


def mamba2_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token over one sequence (the oracle of `mamba2_chunked`).

    Shapes as `mamba2_chunked`. Returns (y [T, H, P] in x's dtype, the final state float32
    [H, P, N]). Does not modify its inputs.
    """
    state = _initial(initial_state, x.shape[1], x.shape[2], B.shape[-1], x.device)[None]
    outs = []
    for t in range(x.shape[0]):
        y, state = mamba2_state_update(state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1],
                                       C[t : t + 1], D)
        outs.append(y)
    return torch.cat(outs), state[0]


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """weight * rms_norm(x * silu(gate)) with the norm taken over groups of `group_size`
    channels (Mamba2's norm after the scan, gate applied first). float32 math; the
    normalised value is cast to x's dtype before the weight multiplies it.

    Shapes: x and gate [..., D] (D a multiple of group_size), weight [D].
    """
    *lead, dim = x.shape
    if dim % group_size:
        raise ValueError(f"{dim} channels are not a multiple of the group size {group_size}")
    h = x.float() * F.silu(gate.float())
    grouped = h.view(*lead, dim // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(*lead, dim).to(x.dtype)


@dataclass(frozen=True, slots=True)
class Mamba2Dims:
    """The shapes of one Mamba2 mixer (per tensor-parallel rank)."""

    num_heads: int  # H
    head_dim: int  # P
    num_groups: int  # G: B and C groups, each serving H / G heads
    state_size: int  # N
    conv_kernel: int  # K: the causal convolution's width
    chunk_size: int  # the SSD scan's chunk length
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, then B, then C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True, slots=True)
class Mamba2Weights:
    """A mixer's weights that the scan reads (its projections stay in the layer)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [H]
    A: torch.Tensor  # [H] float32, negative (-exp(A_log))
    D: torch.Tensor  # [H]


@dataclass(slots=True)
class Mamba2SeqResult:
    """One sequence's states after a step (and at its requested boundaries)."""

    conv_state: torch.Tensor  # [conv_dim, K - 1], the inputs' dtype
    ssm_state: torch.Tensor  # [H, P, N] float32
    boundary_conv_states: list[torch.Tensor]  # one per requested boundary, as conv_state
    boundary_ssm_states: list[torch.Tensor]  # one per requested boundary, as ssm_state


def mamba2_mixer(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    query_lens: Sequence[int],
    conv_states: Sequence[torch.Tensor | None],
    ssm_states: Sequence[torch.Tensor | None],
    weights: Mamba2Weights,
    dims: Mamba2Dims,
    boundaries: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, list[Mamba2SeqResult]]:
    """Convolution, discretization and scan of a ragged batch (the reference the linear
    attention backends' mamba2 variant is checked against).

    xbc [T, conv_dim] and dt [T, H] (raw, before dt_bias and softplus) hold the step's
    tokens sequence by sequence, `query_lens[i]` of sequence i. `conv_states[i]` and
    `ssm_states[i]` are sequence i's states before the step (None: a fresh sequence).
    `boundaries[i]`: offsets into sequence i's new tokens at which its states are also
    returned (prefix-cache checkpoints). A sequence of one token runs the recurrence,
    longer ones the chunked scan. Returns (y [T, H * P] in xbc's dtype, one
    `Mamba2SeqResult` per sequence). Does not modify its inputs.
    """
    if len(conv_states) != len(query_lens) or len(ssm_states) != len(query_lens):
        raise ValueError(
            f"{len(query_lens)} sequences but {len(conv_states)} conv and {len(ssm_states)} "
            "ssm states"
        )
    boundaries = boundaries or [()] * len(query_lens)
    width = dims.conv_kernel
    num_x = dims.intermediate_size
    num_bc = dims.num_groups * dims.state_size
    outs, results, start = [], [], 0
    for n, conv0, ssm0, marks in zip(query_lens, conv_states, ssm_states, boundaries, strict=True):
        seq = xbc[start : start + n]
        conved, conv_state = causal_conv1d(seq, weights.conv_weight, conv0, weights.conv_bias)
        x, B, C = conved.split([num_x, num_bc, num_bc], dim=-1)
        x = x.reshape(n, dims.num_heads, dims.head_dim)
        B = B.reshape(n, dims.num_groups, dims.state_size)
        C = C.reshape(n, dims.num_groups, dims.state_size)
        step = discretize_dt(dt[start : start + n], weights.dt_bias, dims.dt_limit)
        if n == 1 and not marks:
            init = ssm0 if ssm0 is not None else x.new_zeros(dims.ssm_state_shape()).float()
            y, ssm = mamba2_state_update(init[None], x, step, weights.A, B, C, weights.D)
            ssm, marked = ssm[0], []
        else:
            y, ssm, marked = mamba2_chunked(
                x, step, weights.A, B, C, weights.D, ssm0, dims.chunk_size, marks
            )
            marked = list(marked)
        # the conv state at offset b is the last K - 1 inputs before it
        history = torch.cat(
            (seq.new_zeros(width - 1, seq.shape[1]) if conv0 is None else conv0.T.to(seq.dtype),
             seq)
        )
        conv_marks = [history[b : b + width - 1].T.clone() for b in marks]
        outs.append(y.reshape(n, num_x))
        results.append(Mamba2SeqResult(conv_state, ssm, conv_marks, marked))
        start += n
    return torch.cat(outs), results


# ---- the linear-attention variant "mamba2" (tokenmill.platforms.ops.linear_attention) ----------


@dataclass(slots=True)
class Mamba2Inputs:
    """A Mamba2 layer's inputs for the step's tokens (flattened as the metadata): xbc
    [T, conv_dim], the convolution's input (x, then B, then C) in the model dtype; dt
    [T, H], the raw step before dt_bias and softplus; the mixer's scan weights and dims."""

    xbc: torch.Tensor
    dt: torch.Tensor
    weights: Mamba2Weights
    dims: Mamba2Dims


def mamba2_state_spec(dims: Mamba2Dims, dtype: torch.dtype) -> RecurrentStateSpec:
    """A Mamba2 layer's per-sequence state: the convolution's last K - 1 inputs
    [conv_dim, K - 1] in the model dtype, and the SSM state [H, P, N] in float32 (as
    transformers keeps it: a bf16 state would round every step's small update away).
    Tensor parallel runs (`StateTensorSpec.parts`): the conv's x, B and C channels, the
    SSM state's heads (a rank keeps its heads with the B/C groups they read)."""
    bc = dims.num_groups * dims.state_size
    return RecurrentStateSpec(
        "mamba2",
        (
            StateTensorSpec("conv", dims.conv_state_shape(), dtype,
                            (dims.intermediate_size, bc, bc)),
            StateTensorSpec("ssm", dims.ssm_state_shape(), torch.float32, (dims.num_heads,)),
        ),
    )


class Mamba2:
    """The `LinearVariant` of Mamba2: `mamba2_mixer` over tokens [lo, hi) of one sequence."""

    def run(
        self, spec: AttentionSpec, inputs: Mamba2Inputs, lo: int, hi: int,
        state: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        conv, ssm = state
        y, (result,) = mamba2_mixer(
            inputs.xbc[lo:hi], inputs.dt[lo:hi], [hi - lo], [conv], [ssm], inputs.weights,
            inputs.dims,
        )
        return y, [result.conv_state, result.ssm_state]
