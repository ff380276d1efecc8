"""The nvidia and rocm plugins certify T0-T3 with their Triton kernels in Triton's
interpreter (TRITON_INTERPRET=1, CPU tensors), and the suite refuses the nvidia plugin with
a deliberately broken Triton attention kernel (tests/conformance/broken_triton_plugin.py).

With TOKENMILL_WRITE_CERTIFICATES=1 the certification test also copies the certificates it
checked to docs/certificates/<platform>-interpreter.{json,md}: that is how
plugins/triton/certify-interpreter.sh writes them. Each certification runs in a fresh
process: Triton decides at import whether kernels are interpreted, and this session must
not see it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_conformance import HERE, certify, tiers

pytestmark = pytest.mark.certify  # minutes: .ci/run runs these with -m certify

INTERPRETER = {"TRITON_INTERPRET": "1"}
CERTIFICATES = HERE.parents[1] / "docs" / "certificates"


@pytest.mark.parametrize("platform", ["nvidia", "rocm"])
def test_gpu_plugin_certifies_t0_to_t3_in_the_triton_interpreter(tmp_path, platform):
    code, output, cert, markdown = certify(
        tmp_path, "--platform", platform, "--tier", "T0-T3", env=INTERPRETER
    )
    assert code == 0, output[-4000:]
    assert tiers(cert) == {"T0": "passed", "T1": "passed", "T2": "passed", "T3": "passed",
                           "T4": "not_run", "T5": "not_run"}
    assert cert["plugin"]["distribution"] == f"tokenmill-{platform}"
    assert "interpreter on CPU" in cert["plugin"]["platform_version"]
    assert "bf16 tiles upcast to float32" in cert["plugin"]["platform_version"]
    assert cert["hardware"]["device_type"] == "cpu"
    assert set(cert["capabilities"]["dtypes"]) == {"bfloat16", "float32"}
    ids = {t["id"]: t["outcome"] for t in cert["tests"]}
    for expected in (  # the Triton kernels ran, not the references
        "t1/test_attention.py::test_mixed_batches[full-bfloat16-block16-heads9x3]",
        "t1/test_attention.py::test_unwritten_slots_are_never_read[sliding_window-bfloat16]",
        "t1/test_ops.py::test_op_matches_reference[rms_norm-bfloat16]",
        "t1/test_ops.py::test_op_matches_reference[moe_experts-bfloat16]",
        "t1/test_ops.py::test_op_matches_reference[prepack_quantized_linear-bfloat16]",
        "t1/test_ops.py::test_apply_token_bitmask_matches_reference[float32]",
        "t1/test_collectives.py::test_collective[world4-reduce_scatter-bfloat16]",
        "t3/test_greedy.py::test_greedy_matches_reference[qwen3]",
        # every LINEAR variant on the Triton backend (T1 checks each declared variant)
        "t1/test_linear_attention.py::test_backends_match_the_reference[small-0-gated_delta]",
        "t1/test_linear_attention.py::test_backends_match_the_reference[production-0-kda]",
        "t1/test_linear_attention.py::test_backends_match_the_reference[production-0-mamba2]",
        # production shapes: a corner of the sample, split-K past 8k, MLA at rank 512
        "t1/test_attention_shapes.py::test_production_shapes[full-bfloat16-head256-gqa8-block16]",
        "t1/test_attention_shapes.py::test_long_context[full-bfloat16-long_decode-head256-gqa8-block16]",
        "t1/test_mla.py::test_mla_production_shapes[bfloat16]",
        "t3/test_production_shapes.py::test_head128_gqa_preemption_and_prefix_hits[block16]",
        "t3/test_greedy.py::test_greedy_matches_reference[qwen3_next]",
        "t3/test_greedy.py::test_greedy_matches_reference[kimi_linear]",
        "t3/test_greedy.py::test_greedy_matches_reference[bamba]",
    ):
        assert ids.get(expected) == "passed", (expected, ids.get(expected))
    assert "tokenmill-conformance: " + repr(platform) in output
    assert "| T1 " in markdown and "- platform version: triton" in markdown
    if os.environ.get("TOKENMILL_WRITE_CERTIFICATES") == "1":
        CERTIFICATES.mkdir(parents=True, exist_ok=True)
        for suffix in ("json", "md"):
            shutil.copy(Path(tmp_path) / f"cert.{suffix}",
                        CERTIFICATES / f"{platform}-interpreter.{suffix}")


def test_broken_triton_kernel_is_refused_by_t1(tmp_path):
    plugin = HERE / "broken_triton_plugin.py"
    code, output, cert, markdown = certify(
        tmp_path, "--platform", "broken-triton", "--plugin", f"{plugin}:plugin", "--tier", "T0-T1",
        # the broken kernel runs one interpreted program per (token, head): a few cases only
        "--", "-k", "test_contract or (last_partial_block and full) or (unwritten_slots and full "
        "and float32) or (test_op_matches_reference and rms_norm)",
        env=INTERPRETER,
    )
    assert code == 1, output[-4000:]
    assert tiers(cert)["T0"] == "passed" and tiers(cert)["T1"] == "failed"
    failed = {f["id"] for f in cert["failures"]}
    assert {f["tier"] for f in cert["failures"]} == {"T1"}
    partial_block = "t1/test_attention.py::test_edge_batches[full-last_partial_block]"
    poisoned = "t1/test_attention.py::test_unwritten_slots_are_never_read[full-float32]"
    assert partial_block in failed and poisoned in failed
    # only attention is broken: the plugin's Triton ops still pass
    outcomes = {t["id"]: t["outcome"] for t in cert["tests"]}
    assert outcomes["t1/test_ops.py::test_op_matches_reference[rms_norm-float32]"] == "passed"
    assert "REFUSED: failing required tiers ['T1']" in output
    assert "**NOT CERTIFIED (quick check, not a certificate)**" in markdown
