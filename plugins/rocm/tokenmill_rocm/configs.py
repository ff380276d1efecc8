"""The rocm plugin's launch settings for the shared Triton kernels, by gfx architecture.

CDNA runs 64-lane wavefronts with 64 KiB of LDS per CU on gfx942 (MI300X, MI325X) and
160 KiB on gfx950 (MI350X, MI355X). Triton's AMD backend pipelines global loads through
registers rather than a multi-stage shared-memory ring, so num_stages stays at 1-2; query
tiles are larger than on NVIDIA (128 rows) since a CU holds more registers per lane.
Decode steps use 16-row tiles and split long contexts into 16 segments (split-K) from 2048
tokens on. In interpreter mode the gfx942 settings are used, with bf16 tiles upcast.
"""

from __future__ import annotations

from tokenmill_triton.configs import AttentionConfig, KernelConfigs, MoEConfig

CDNA3 = KernelConfigs(  # gfx942
    attention=AttentionConfig(block_m=128, tile_n=64, num_warps=4, num_stages=1,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              tile_elements=64 * 128),
    moe=MoEConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=2),
)
CDNA4 = KernelConfigs(  # gfx950
    attention=AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=2,
                              decode_block_m=16, decode_tile_n=64, decode_num_warps=4,
                              tile_elements=128 * 128),
    moe=MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=2),
)
INTERPRETER = KernelConfigs(
    attention=CDNA3.attention, elementwise=CDNA3.elementwise, moe=CDNA3.moe,
    upcast_bf16_dot=True,
)


def for_arch(gcn_arch: str) -> KernelConfigs:
    """Settings for a device whose gcnArchName is `gcn_arch` ("gfx942:sramecc+:xnack-")."""
    return CDNA4 if gcn_arch.startswith("gfx95") else CDNA3
