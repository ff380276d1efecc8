"""FLOPs and bytes of each op of one step, on one device: the performance model's atoms.

Every function returns an `OpCost` (op class, FLOPs, bytes moved to or from device memory)
for work already cut to one device (the caller divides heads, rows and tokens by the
parallel mix). Counts are multiply-adds x 2; bytes are what a fused kernel must read and
write at least once (weights once per step, activations in and out, the KV cache or state
it reads and the rows it writes). Notation in the docstrings: T tokens in the step, a
sequence `Seq(cached, new)` computing `new` tokens after `cached` ones, h query heads, g KV
heads, d head width, b bytes per activation / KV value, w bytes per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64  # tokens per chunk of the chunked linear-attention / SSD scans (FLA's, ours)
STATE_BYTES = 4  # recurrent states are float32
# FLOPs per state element per token of a recurrent step: decay (1), k^T S (2), the delta
# update S += k (x) delta (2), q^T S (2), the gate (1): 8 per (dk x dv) element.
RECURRENT_FLOPS_PER_STATE = 8


@dataclass(frozen=True, slots=True)
class OpCost:
    op: str  # op class, the unit calibration measures: "gemm", "attention_full", ...
    flops: float
    bytes: float
    inner: int = 0  # a GEMM's reduced dim k (0: not a GEMM); its efficiency depends on it
    outer: int = 0  # and on its output width n
    calls: float = 1.0  # kernel calls it stands for, each paying the op class's latency

    def scaled(self, factor: float) -> OpCost:
        """The same call doing `factor` times the work."""
        return OpCost(self.op, self.flops * factor, self.bytes * factor, self.inner, self.outer,
                      self.calls)

    def repeated(self, count: int) -> OpCost:
        """`count` such calls (layers of one shape)."""
        return OpCost(self.op, self.flops * count, self.bytes * count, self.inner, self.outer,
                      self.calls * count)


@dataclass(frozen=True, slots=True)
class Seq:
    """`count` sequences each computing `new` tokens after `cached` ones in this step."""

    cached: int
    new: int
    count: int = 1

    @property
    def decode(self) -> bool:
        return self.new == 1 and self.cached > 0


def visible_keys(seq: Seq, window: int = 0) -> int:
    """Query-key pairs of one sequence under causal attention: sum over its new tokens i of
    min(cached + i + 1, window) (window 0: no limit)."""
    c, n = seq.cached, seq.new
    if not window or c + n <= window:
        return n * c + n * (n + 1) // 2
    full = max(0, min(n, window - c))  # tokens that still see everything before them
    return full * c + full * (full + 1) // 2 + (n - full) * window


def keys_read(seq: Seq, window: int = 0) -> int:
    """Cached and new keys one sequence's attention reads (each once, flash-style)."""
    total = seq.cached + seq.new
    return min(total, window + seq.new - 1) if window else total


def gemm(rows: int, k: int, n: int, weight_bytes: float, act_bytes: int, op: str = "gemm") -> OpCost:
    """[rows, k] x [k, n]: 2 rows k n FLOPs; the weight once, the input and output rows."""
    return OpCost(op, 2.0 * rows * k * n, k * n * weight_bytes + rows * (k + n) * act_bytes, k, n)


def attention(seqs: list[Seq], heads: int, kv_heads: int, qk_dim: int, v_dim: int,
              kv_bytes: int, act_bytes: int, window: int = 0) -> OpCost:
    """Multi-head attention (full, or a sliding `window`): 2 h (qk + v) FLOPs per visible
    query-key pair (scores, then the weighted values); reads each visible cached key and
    value of the g KV heads once, writes the new ones, reads q and writes the output."""
    pairs = sum(s.count * visible_keys(s, window) for s in seqs)
    read = sum(s.count * keys_read(s, window) for s in seqs)
    tokens = sum(s.count * s.new for s in seqs)
    kv_row = kv_heads * (qk_dim + v_dim) * kv_bytes
    flops = 2.0 * heads * (qk_dim + v_dim) * pairs
    moved = (read + tokens) * kv_row + tokens * heads * (qk_dim + v_dim) * act_bytes
    op = "attention_sliding" if window else "attention_full"
    return OpCost(op, flops, moved)


def mla_attention(seqs: list[Seq], heads: int, nope: int, rope: int, v_dim: int, rank: int,
                  kv_bytes: int, act_bytes: int) -> OpCost:
    """Multi-head latent attention over the cached latent rows (rank + rope per token).
    Decode rows run absorbed: scores over the latent and rope parts, 2 h (rank + rope)
    per pair, and the weighted latents, 2 h rank per pair. Prefill runs decompressed
    (kv_b_proj's GEMM, counted apart by `latent_up`): 2 h (nope + rope + v) per pair."""
    flops = 0.0
    moved = 0.0
    for s in seqs:
        pairs = s.count * visible_keys(s)
        if s.decode:
            flops += 2.0 * heads * (2 * rank + rope) * pairs
        else:
            flops += 2.0 * heads * (nope + rope + v_dim) * pairs
            # decompressed keys and values written by kv_b_proj and read here
            moved += s.count * (s.cached + s.new) * heads * (nope + rope + v_dim) * act_bytes
        moved += s.count * (keys_read(s) + s.new) * (rank + rope) * kv_bytes
        moved += s.count * s.new * heads * (nope + rope + v_dim) * act_bytes
    return OpCost("attention_mla", flops, moved)


def latent_up(seqs: list[Seq], rank: int, out: int, weight_bytes: float, act_bytes: int) -> OpCost:
    """MLA's kv_b_proj [rank -> h (nope + v)]: prefill decompresses every cached and new
    latent row of the sequence (2 (cached + new) rank out); decode absorbs it into the
    query and the output (2 rank out per row). The weight is read once per step."""
    rows = sum(s.count * (1 if s.decode else s.cached + s.new) for s in seqs)
    return OpCost("gemm", 2.0 * rows * rank * out, rank * out * weight_bytes + rows * rank * act_bytes,
                  rank, out)


def recurrent(seqs: list[Seq], heads: int, dk: int, dv: int, act_bytes: int, variant: str) -> OpCost:
    """A linear-attention / SSM layer's scan (Gated DeltaNet, KDA, Mamba2's SSD) over h
    heads with a dk x dv state each. Decode rows take the recurrent step,
    `RECURRENT_FLOPS_PER_STATE` FLOPs per state element; prefill the chunked form, per
    token and head 2 C (2 dk + dv) (the chunk's q k^T, k k^T and its weighted values) +
    6 dk dv (reading, applying and updating the state once per chunk of C = `CHUNK`).
    Bytes: each sequence's state read and written once per step, and per token its q, k,
    v and gate in (2 dk + 2 dv per head) and its output out (dv per head)."""
    state = heads * dk * dv
    flops = 0.0
    moved = 0.0
    for s in seqs:
        tokens = s.count * s.new
        if s.decode:
            flops += RECURRENT_FLOPS_PER_STATE * state * tokens
        else:
            flops += tokens * heads * (2 * CHUNK * (2 * dk + dv) + 6 * dk * dv)
        moved += s.count * 2 * state * STATE_BYTES + tokens * heads * (2 * dk + 3 * dv) * act_bytes
    return OpCost(f"recurrent_{variant}", flops, moved)


def short_conv(seqs: list[Seq], channels: int, kernel: int, act_bytes: int) -> OpCost:
    """The causal depthwise convolution before a recurrent scan: 2 K FLOPs per channel and
    token; its input and output rows, and each sequence's (K - 1)-row state in and out."""
    tokens = sum(s.count * s.new for s in seqs)
    states = sum(s.count for s in seqs)
    moved = 2 * tokens * channels * act_bytes + 2 * states * channels * (kernel - 1) * act_bytes
    return OpCost("elementwise", 2.0 * kernel * channels * tokens, moved)


def experts(rows: int, tokens: int, local_experts: int, num_experts: int, top_k: int,
            hidden: int, inter: int, weight_bytes: float, act_bytes: int) -> list[OpCost]:
    """Routed experts on one device: `rows` (token, expert) pairs through gated experts of
    `inter`: gate and up [H -> 2 I] (4 H I FLOPs per row), then down [I -> H] (2 H I).
    Weights: each local expert that any of the step's `tokens` routes to is read once;
    with top-k over E experts drawn evenly, an expert is missed by all of them with
    probability (1 - k / E) ^ tokens. Activations: each row's hidden in and out, its
    2 I gate and up values out and in. One call (its latency on the first half)."""
    touched = local_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
    up = OpCost("moe", 4.0 * rows * hidden * inter,
                touched * 2 * hidden * inter * weight_bytes + rows * (hidden + 2 * inter) * act_bytes,
                hidden, 2 * inter)
    down = OpCost("moe", 2.0 * rows * hidden * inter,
                  touched * hidden * inter * weight_bytes + rows * (inter + hidden) * act_bytes,
                  inter, hidden, calls=0.0)  # one experts call runs both halves
    return [up, down]


def rms_norm(tokens: int, width: int, act_bytes: int) -> OpCost:
    """x / rms(x) * w: 4 FLOPs per element; the row in and out."""
    return OpCost("elementwise", 4.0 * tokens * width, 2.0 * tokens * width * act_bytes)


def gated_activation(tokens: int, inter: int, act_bytes: int) -> OpCost:
    """act(gate) * up: about 4 FLOPs per output element (the activation's exp, a
    multiply, a divide); reads 2 I and writes I per token."""
    return OpCost("elementwise", 4.0 * tokens * inter, 3.0 * tokens * inter * act_bytes)


def rotary(tokens: int, heads: int, kv_heads: int, rot_dim: int, act_bytes: int) -> OpCost:
    """Rotary embedding of q and k: 3 FLOPs per rotated value, read and written once."""
    values = tokens * (heads + kv_heads) * rot_dim
    return OpCost("elementwise", 3.0 * values, 2.0 * values * act_bytes)


def embedding(tokens: int, hidden: int, act_bytes: int) -> OpCost:
    """Row lookup: one row read and written per token, no FLOPs."""
    return OpCost("elementwise", 0.0, 2.0 * tokens * hidden * act_bytes)
