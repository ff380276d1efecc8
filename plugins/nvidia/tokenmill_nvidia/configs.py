"""The nvidia plugin's launch settings for the shared Triton kernels, by architecture.

Chosen from the compute capability at activation. Tiles follow the shared memory and
register file of each generation: Hopper (sm90: H100, H200) and Blackwell (sm100: B200)
take 64-128 query rows and 64-key tiles with a 3-stage software pipeline; Ampere (sm80)
has less shared memory per SM, so 2 stages. Decode steps use 16-row tiles (GQA packs the
group into them) and split long contexts across 16 segments (split-K) once the longest
sequence reaches 2048 tokens. The linear-attention scans and the MoE GEMMs are sized so
that ptxas keeps them in registers on sm_90 and sm_100 (the ahead-of-time compile records,
docs/certificates/nvidia-compile*.md). In interpreter mode the Hopper settings are used, so the
certified tile logic is the one an H100 runs, with bf16 tiles upcast before tl.dot (float32
and MoE tiles excepted: see INTERPRETER).
"""

from __future__ import annotations

from dataclasses import replace

from tokenmill_triton.configs import (
    AttentionConfig,
    KernelConfigs,
    LinearAttentionConfig,
    MoEConfig,
)

# The chunked scans keep [chunk, 128] key tiles, the [128, block_v] state slice and their
# float32 products (tl.dot at "ieee" runs on FMA units, every operand in registers) per
# program: with 64-token chunks and 4 warps ptxas spilled 70-680 KB per kernel on sm_100
# and took up to 40 minutes for one of them; 16-token chunks, 16 value columns (Mamba2: 16
# head-dim rows) and 8 key channels per KDA pair tile over 8 warps fit in 232-244
# registers without a spill (docs/certificates/nvidia-compile.md).
LINEAR = LinearAttentionConfig(chunk_size=16, block_v=16, pair_block_k=8, ssd_block_p=16,
                               num_warps=8)

# float32 (tl.dot at "ieee" on FMA units) spilled where 16-bit tiles fit: prefill of head
# 256 in 64 rows x 4 warps (sm_90: 40 KB at 32 query rows still) or 128 rows x 8 warps
# (sm_100: 35-79 KB), decode of head 128 in 64-key tiles (328-360 bytes), the 128-column
# MoE tiles (32-200 bytes). float32 prefill takes 16 query rows on Hopper, 32 on
# Blackwell, and float32 K/V tiles half the keys (32 of head 128, 16 of head 256); MoE
# tiles are 64x64 (no spill on either).
HOPPER = KernelConfigs(
    attention=AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              float32_block_m=16, float32_tile_elements=32 * 128),
    moe=MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
    linear=LINEAR,
)
# 16-bit decode keeps 64-key tiles (32 made float16 / bfloat16 head 64 spill 8 bytes)
BLACKWELL = KernelConfigs(
    attention=AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=3,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              float32_block_m=32, float32_tile_elements=32 * 128),
    moe=MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=4),
    linear=LINEAR,
)
AMPERE = KernelConfigs(
    attention=AttentionConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2,
                              decode_block_m=16, decode_tile_n=32, decode_num_warps=4),
    moe=MoEConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3),
)
# The interpreter runs one Python loop per program: Hopper's float32 prefill rows (16) and
# K/V tiles (32 x 128) and its 64x64 MoE tiles, chosen against ptxas spills that the
# interpreter does not have, made the certification take twice as long (1650 s against
# 830 s). It keeps Hopper's 16-bit tiles, which every bf16 / fp16 case runs, and the wider
# float32 and MoE tiles; tests/triton/nvidia_config_cases.py runs the real Hopper and
# Blackwell float32 and MoE settings against the references in the interpreter.
INTERPRETER = KernelConfigs(
    attention=replace(HOPPER.attention, float32_block_m=0, float32_tile_elements=0),
    elementwise=HOPPER.elementwise,
    moe=replace(HOPPER.moe, block_n=128),
    upcast_bf16_dot=True,
)


def for_capability(major: int) -> KernelConfigs:
    """Settings for a device of compute capability `major`.x."""
    if major >= 10:
        return BLACKWELL
    if major == 9:
        return HOPPER
    return AMPERE
