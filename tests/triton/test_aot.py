"""tokenmill_triton.aot without a GPU: reading `ptxas -v` logs (captured from the ptxas in
the triton wheel, tests/triton/data) and the per-kernel timeout of compile_target."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill_triton.aot import _amdgcn_usage, compile_target, ptxas_usage

DATA = Path(__file__).parent / "data"


def test_ptxas_usage_of_a_blackwell_log():
    # ptxas-blackwell 13.4 on the sm_100 PTX of the Gated DeltaNet chunked scan (float32,
    # CHUNK=64, 4 warps, `.reqntid 128`): it keeps 32 registers and spills (stores 66396 +
    # loads 101804 bytes); cuobjdump on the cubin says REG:32 too
    log = (DATA / "ptxas_sm100_gated_delta_chunked.log").read_text()
    assert ptxas_usage(log, "_chunked_kernel") == (32, 66396 + 101804)


def test_ptxas_usage_reads_the_named_entry_of_several():
    # ptxas_sm90_two_entries.ptx: other_kernel (110 registers) is compiled first, then
    # main_kernel (8); a reader of the first "Used N registers" line gets main_kernel wrong
    log = (DATA / "ptxas_sm90_two_entries.log").read_text()
    assert ptxas_usage(log, "main_kernel") == (8, 0)
    assert ptxas_usage(log, "other_kernel") == (110, 0)
    with pytest.raises(ValueError, match="no entry function 'third_kernel'"):
        ptxas_usage(log, "third_kernel")


def test_ptxas_usage_without_usage_lines_says_so():
    log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Compile time = 1 ms\n"
    with pytest.raises(ValueError, match="no register or spill line for 'k'"):
        ptxas_usage(log, "k")


def test_amdgcn_sgprs_spilled_to_vgpr_lanes_are_not_memory_spills():
    # the gfx942 float32 decode attention (Triton 3.9): 10 SGPRs live in VGPR lanes
    # (v_writelane), no scratch: a register move, noted but not a spill
    meta = (DATA / "amdgcn_gfx942_paged_attention_sgpr_lanes.meta").read_text()
    assert _amdgcn_usage(meta) == (115, 0, 10, None)


def test_amdgcn_vgpr_spills_count_their_scratch_bytes():
    # a gfx942 float32 delta-rule chunked scan (4 warps, wide tiles of a trial launch): 939
    # VGPRs and 271 SGPRs spilled, 3760 bytes of scratch per lane
    meta = (DATA / "amdgcn_gfx942_chunked_scratch.meta").read_text()
    assert _amdgcn_usage(meta) == (512, 3760, 271, None)
    registers, spills, lanes, error = _amdgcn_usage("no metadata here")
    assert (registers, spills) == (None, None) and "private_segment_fixed_size" in error


@pytest.mark.long  # three processes that import torch and triton: about half a minute
def test_a_kernel_past_the_timeout_is_recorded_and_the_rest_still_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = "attention decode float32 head 64 gqa 4 window 1000"  # write_kv, then attention
    records = compile_target("sm_90", "tokenmill_nvidia.configs:HOPPER", [case],
                             kernel_timeout=0.01)
    assert [r["kernel"] for r in records] == ["write_kv_kernel", "paged_attention_kernel"]
    for r in records:
        assert r["case"] == case and r["registers"] is None
        assert r["error"].startswith("compile timed out after 0 s")
