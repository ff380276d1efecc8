"""Launch settings of the shared kernels, chosen by the calling plugin per device.

The kernels never pick their own tile sizes or warps: a plugin builds one `KernelConfigs`
for its device (an H100 wants different tiles from an MI300X) and every launch reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Ragged paged attention tiles.

    block_m: query rows per program (tokens x the query heads of one KV head, so GQA
    reads each key tile once for the whole group); tile_n: keys per inner-loop tile;
    num_segments / split_k_min_seq_len: decode-only steps whose longest context reaches
    split_k_min_seq_len split each sequence's keys into num_segments programs (split-K,
    "flash decoding") and combine them in a second kernel, so a few long sequences still
    fill the device.
    """

    block_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    decode_block_m: int = 16
    decode_tile_n: int = 64
    decode_num_warps: int = 4
    num_segments: int = 16
    split_k_min_seq_len: int = 2048
    # keys x head dims of one K or V tile at most: head size 256 halves a 64-key tile
    tile_elements: int = 64 * 128
    # float32 at "ieee" precision: tl.dot runs on FMA units with whole operand rows in
    # registers, so a tile that fits 16-bit types can spill; prefill rows per program and
    # keys x head dims of a K or V tile for float32 queries (0: block_m / tile_elements)
    float32_block_m: int = 0
    float32_tile_elements: int = 0


@dataclass(frozen=True, slots=True)
class ElementwiseConfig:
    """Row-wise kernels (norms, rotary, activation, KV write, bitmask)."""

    num_warps: int = 4
    block_n: int = 1024  # columns per program of silu_and_mul / the bitmask


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Grouped expert GEMM tiles (one program: block_m routed rows x block_n outputs)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """The recurrent kernels: Gated DeltaNet (tokenmill_triton.gated_delta), KDA
    (tokenmill_triton.kda) and Mamba2's SSD (tokenmill_triton.mamba2).

    chunk_size: tokens per step of the chunked scans (a power of two, >= 16: the tl.dot
    minimum); block_v: value columns per program of the delta rules (the state slice
    [dk, block_v] lives in registers); pair_block_k: key channels per [chunk, chunk,
    channels] tile of KDA's per-channel pair decays; ssd_block_p: head-dim rows per
    program of Mamba2's scan (the state slice [block_p, N] in registers); conv_block_c /
    conv_block_t: channels and tokens per tile of the conv."""

    chunk_size: int = 64
    block_v: int = 32
    pair_block_k: int = 16
    ssd_block_p: int = 32
    conv_block_c: int = 128
    conv_block_t: int = 16
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Latent attention (tokenmill_triton.mla): heads of one token per program (they share
    every latent tile), keys per inner-loop tile, latent output columns per program
    (block_r) and latent columns per step of the score (block_k)."""

    block_h: int = 16
    tile_n: int = 32
    num_warps: int = 4
    block_r: int = 128
    block_k: int = 64


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """Weight-only quantized GEMM tiles (tokenmill_triton.quant): block_m rows x block_n
    output columns per program, block_k input columns per step at most (the host halves it
    until it divides the weight's group); steps of at most small_m rows (decode) take
    16-row tiles, tl.dot's smallest."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    small_m: int = 16
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class KernelConfigs:
    """Everything a plugin decides about launches.

    upcast_bf16_dot: convert bf16 tiles to float32 before `tl.dot`. Triton 3.9's
    interpreter computes bf16 `tl.dot` wrongly (max error ~5e10 on 16x32x16) while float32
    is exact, so interpreter mode must set it; on a GPU it only costs speed.
    fp32_dot_precision: "ieee" keeps float32 matmuls exact (the conformance tolerance of
    1e-4 rules out tf32); a plugin may choose "tf32" for speed where it declares so.
    """

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    elementwise: ElementwiseConfig = field(default_factory=ElementwiseConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    linear: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    upcast_bf16_dot: bool = False
    fp32_dot_precision: str = "ieee"
