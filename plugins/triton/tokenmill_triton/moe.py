"""Fused mixture of experts on Triton: top-k routing, then two grouped expert GEMMs.

    router logits -> routing_kernel (softmax, top-k, renormalise) -> (expert ids, weights)
    -> align: the (token, k) pairs sorted by expert, each expert's run padded to block_m
    -> grouped GEMM 1: x[token] @ w1[e].T  (gate | up)   -> silu_and_mul
    -> grouped GEMM 2: act @ w2[e].T * routing weight    -> sum over k

Every program of a grouped GEMM computes one block_m x block_n tile for one expert, so each
expert's weights stream once per block of its tokens (no per-token GEMV). The grid is an
upper bound fixed by the token count (cdiv(T * k, block_m) + experts blocks, idle ones
return at once), so no host synchronisation is needed. `moe_experts` is the core's op of
that name (`w13` [E, 2 * I, H] holds gate then up, `w2` [E, H, I]);
`fused_moe` adds the Triton routing in front.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.elementwise import act_and_mul
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype


@triton.jit
def _routing_kernel(
    logits_ptr, ids_ptr, weights_ptr, stride_logits, num_experts,
    TOP_K: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One program per token: softmax over experts, then the top-k by repeated argmax."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    remaining = tl.where(valid, probs, -1.0)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        weight = tl.max(remaining, axis=0)
        tl.store(ids_ptr + token * TOP_K + k, best.to(tl.int32))
        tl.store(weights_ptr + token * TOP_K + k, weight)
        total += weight
        remaining = tl.where(experts == best, -1.0, remaining)
    if RENORMALIZE:  # TOP_K need not be a power of two (6 experts), so no tl.arange here
        for k in tl.static_range(TOP_K):
            chosen = tl.load(weights_ptr + token * TOP_K + k)
            tl.store(weights_ptr + token * TOP_K + k, chosen / total)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, top_k], weights float32 [T, top_k]), best first."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..{num_experts} (the number of experts)")
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    logits = router_logits.contiguous()
    if num_tokens:
        _routing_kernel[(num_tokens,)](
            logits, ids, weights, logits.stride(0), num_experts,
            TOP_K=top_k, EXPERTS_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
        )
    return ids, weights


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs grouped by expert, each group padded to a multiple of block_m.

    Returns (pair ids int32 [num_blocks * block_m], the pad value being T * k; expert of
    each block int32 [num_blocks], -1 for blocks past the last group), with num_blocks =
    cdiv(T * k, block_m) + num_experts, an upper bound known without a host sync."""
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_ends = torch.cumsum(padded // block_m, 0)
    blocks = torch.arange(num_blocks, device=device)
    block_expert = torch.searchsorted(block_ends, blocks, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pair_ids_ptr, block_expert_ptr, weights_ptr, bias_ptr,
    n, k, num_pairs, num_blocks,
    stride_am, stride_be, stride_bn, stride_cm, stride_bias,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k: A is x indexed by token; 1: A indexed by pair
    MUL_WEIGHT: tl.constexpr,  # round to A's dtype (as a GEMM in it), then the routing weight
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    """C[pair] = A[row(pair)] @ B[expert].T + bias[expert] (times the pair's routing weight)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n, BLOCK_N)
    # grouped order: GROUP_M row blocks share each weight tile while it is in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)
        acc = to_dtype(acc, a_ptr.dtype.element_ty, RTNE_BF16).to(tl.float32) * w[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             to_dtype(acc, c_ptr.dtype.element_ty, RTNE_BF16),
             mask=pair_ok[:, None] & col_ok[None, :])


def _grouped_gemm(a, b, out, pair_ids, block_expert, weights, rows_per_token, configs,
                  bias=None):
    cfg = configs.moe
    num_blocks = block_expert.numel()
    n, k = b.shape[1], b.shape[2]
    grid = (num_blocks * triton.cdiv(n, cfg.block_n),)
    bias = None if bias is None else bias.contiguous()
    _grouped_gemm_kernel[grid](
        a, b, out, pair_ids, block_expert, weights if weights is not None else out,
        bias if bias is not None else out,
        n, k, out.shape[0], num_blocks,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        A_ROWS_PER_TOKEN=rows_per_token, MUL_WEIGHT=weights is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        UPCAST=configs.upcast_bf16_dot and a.dtype == torch.bfloat16,
        DOT_PRECISION=configs.fp32_dot_precision, RTNE_BF16=exact_bf16_casts(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    *,
    configs: KernelConfigs,
) -> torch.Tensor:
    """reference.moe_experts (the core's op) on the grouped GEMMs: [T, H] in hidden's dtype,
    out[t] = sum_j w[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), e = topk_ids[t, j];
    each expert GEMM rounds to the weights' dtype, the weighted sum is float32."""
    if activation not in ("silu", "swiglu_oai"):
        raise ValueError(f"MoE activation {activation!r} is not one of ('silu', 'swiglu_oai')")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    top_k = topk_ids.shape[1]
    capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        # (a host sync, so not inside a graph capture: the capture's router is the model's)
        raise ValueError(f"topk_ids holds experts outside [0, {num_experts}): "
                         f"{topk_ids.min().item()}..{topk_ids.max().item()}")
    x, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    pair_ids, block_expert = align_by_expert(topk_ids, num_experts, configs.moe.block_m)
    num_pairs = num_tokens * top_k
    gate_up = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, pair_ids, block_expert, None, top_k, configs, w13_bias)
    act = act_and_mul(gate_up, configs.elementwise, activation, swiglu_alpha, swiglu_limit)
    down = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=x.device)
    weights = topk_weights.float().contiguous().flatten()
    _grouped_gemm(act, w2, down, pair_ids, block_expert, weights, 1, configs, w2_bias)
    return down.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w1: torch.Tensor,  # [E, 2 * I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    configs: KernelConfigs,
    renormalize: bool = True,
) -> torch.Tensor:
    """Routing (softmax, top-k, optionally renormalised) then `moe_experts` with silu: sum
    over the top-k experts e of weight_e * (silu(x W1g_e^T) * (x W1u_e^T)) W2_e^T. [T, H] in
    hidden's dtype; does not modify its inputs."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w1.shape
    if w1.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, two_i // 2):
        raise ValueError(f"fused_moe: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden {hidden_size} with {num_experts} experts")
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    expert_ids, weights = route(router_logits, top_k, renormalize)
    return moe_experts(hidden, w1, w2, weights, expert_ids, configs=configs)
