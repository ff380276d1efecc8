"""The rocm plugin's launch settings for the shared Triton kernels, by gfx architecture.

CDNA runs 64-lane wavefronts with 64 KiB of LDS per CU on gfx942 (MI300X, MI325X) and
160 KiB on gfx950 (MI350X, MI355X). Triton's AMD backend pipelines global loads through
registers rather than a multi-stage shared-memory ring, so num_stages stays at 1-2; query
tiles are larger than on NVIDIA (128 rows) since a CU holds more registers per lane.
Decode steps use 16-row tiles and split long contexts into 16 segments (split-K) from 2048
tokens on. The linear-attention scans are sized from the ahead-of-time compile records
(docs/certificates/rocm-compile.md). In interpreter mode the gfx942 attention, elementwise
and MoE settings are used, with bf16 tiles upcast, and the default linear-attention tiles.
"""

from __future__ import annotations

from tokenmill_triton.configs import (
    AttentionConfig,
    KernelConfigs,
    LinearAttentionConfig,
    MoEConfig,
)

# The chunked scans in the default tiles (64-token chunks, 32 value columns, 16 key channels
# per KDA pair tile, 4 warps) ran out of the 512 VGPRs + AGPRs a lane on gfx942 and spilled
# to scratch: Gated DeltaNet 1052-1304 bytes, KDA 4840 (72 s to compile), Mamba2 1204.
# 16-token chunks, 16 value columns and 16 Mamba2 head-dim rows over 8 warps (256 registers
# a lane) compile Gated DeltaNet and Mamba2 in 149-174 VGPRs without a VGPR spill. KDA's
# pair tile takes 4 key channels: 8 channels over 8 warps hit 256 VGPRs with 17 SGPR spills
# (bf16: 3 VGPRs to scratch too), 8 over 4 warps 306-326 VGPRs and 63-66 SGPR spills, 4 over
# 8 warps 243-251 VGPRs and 2-4 SGPR spills. What spills left (here and in paged attention)
# are SGPRs parked in VGPR lanes (v_writelane, no scratch memory): docs/rocm.md.
LINEAR = LinearAttentionConfig(chunk_size=16, block_v=16, pair_block_k=4, ssd_block_p=16,
                               num_warps=8)

CDNA3 = KernelConfigs(  # gfx942
    attention=AttentionConfig(block_m=128, tile_n=64, num_warps=4, num_stages=1,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              tile_elements=64 * 128),
    moe=MoEConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=2),
    linear=LINEAR,
)
# gfx950 prefill took 8 warps at first: 512 lanes a program leave each lane 256 VGPRs and AGPRs,
# and 128 query rows of head 256 spilled 548-692 bytes to scratch in every dtype (float32
# head 128: 12 bytes); halving the K/V tile (64 keys x 128 dims) still spilled 96-804. 4
# warps, as on gfx942, compile every prefill tile in 169-437 VGPRs without a VGPR spill.
CDNA4 = KernelConfigs(  # gfx950
    attention=AttentionConfig(block_m=128, tile_n=64, num_warps=4, num_stages=2,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              tile_elements=128 * 128),
    moe=MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=2),
    linear=LINEAR,
)
# the interpreter certification keeps the default linear tiles (its run time was measured
# on them); tests/triton/rocm_config_cases.py runs LINEAR in the interpreter
INTERPRETER = KernelConfigs(
    attention=CDNA3.attention, elementwise=CDNA3.elementwise, moe=CDNA3.moe,
    upcast_bf16_dot=True,
)


def for_arch(gcn_arch: str) -> KernelConfigs:
    """Settings for a device whose gcnArchName is `gcn_arch` ("gfx942:sramecc+:xnack-")."""
    return CDNA4 if gcn_arch.startswith("gfx95") else CDNA3
