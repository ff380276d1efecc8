"""Expert parallel and tensor parallel for MoE (and Gemma 3) models over the "mp" executor
and gloo: greedy tokens identical to one process.

- ep: `enable_expert_parallel` with tensor_parallel_size 2 (Qwen3-MoE, gpt-oss) and 4
  (Mixtral: one expert per rank, KV heads replicated): attention split by heads, each
  rank holding its experts whole, tokens dispatched and combined all-to-all (the counted
  bytes say the all-to-all ran, and how much each rank's experts take);
- tp without EP: every expert's intermediate dim split (Qwen3-MoE, whose layer 1 is
  dense, gpt-oss with expert biases and sinks), and Gemma 3.
"""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from tokenmill import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "gemma3")


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint dir, one process's greedy tokens, its parameter bytes)."""
    out = {}
    for arch in ARCHS:
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        llm = _llm(path)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        out[arch] = (path, tokens, llm.engine.executor.collective_rpc("parameter_bytes")[0])
        llm.engine.shutdown()
    return out


def _expert_bytes(path) -> int:
    """Bytes of every expert tensor of the checkpoint (float32)."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(
            f.get_tensor(k).numel() * 4 for k in f.keys() if ".experts." in k
        )


@pytest.mark.parametrize(
    "arch, tp, ep",
    [
        ("qwen3_moe", 2, True),  # the default run keeps one case each of EP and TP-only MoE
        pytest.param("gpt_oss", 2, True, marks=pytest.mark.long),
        pytest.param("mixtral", 4, True, marks=pytest.mark.long),
        pytest.param("qwen3_moe", 2, False, marks=pytest.mark.long),
        ("gpt_oss", 2, False),
        pytest.param("gemma3", 2, False, marks=pytest.mark.long),
    ],
)
def test_greedy_matches_one_process(models, arch, tp, ep):
    path, want, full_bytes = models[arch]
    kw = {"enable_expert_parallel": True} if ep else {}
    llm = _llm(path, tensor_parallel_size=tp, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        rpc = llm.engine.executor.collective_rpc
        dispatched = rpc("communicated_op_bytes", ("tp", "all_to_all_single"))
        per_rank = rpc("parameter_bytes")
    finally:
        llm.engine.shutdown()
    if ep:
        # every rank dispatched rows and returned outputs through the all-to-all
        assert all(b > 0 for b in dispatched), dispatched
    else:
        assert dispatched == [0] * tp
    # weights sharded on load: each rank holds 1/tp of the experts (EP: whole experts;
    # TP: every expert's slice) and about 1/tp of the rest
    assert max(per_rank) < full_bytes / tp * 1.3, (per_rank, full_bytes)
    if arch != "gemma3":
        assert max(per_rank) < full_bytes - _expert_bytes(path) * (tp - 1) / tp * 0.99


def test_bad_expert_sizes_are_named():
    from transformers import Qwen3MoeConfig

    from tokenmill.model.registry import family_for

    config = Qwen3MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=6, moe_intermediate_size=30, intermediate_size=64,
    )
    local_config = family_for(config).local_config
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        local_config(config, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="intermediate size 30; try enable_expert_parallel"):
        local_config(config, 4)
    assert local_config(config, 2, expert_parallel=True).intermediate_size == 32


def test_serve_flag_reaches_engine_args(capsys):
    from tokenmill.server.cli import main

    argv = ["serve", "--enable-expert-parallel", "-tp", "2", "--distributed-executor-backend",
            "uni", "--port", "1"]
    assert main(argv) == 2  # rejected by EngineArgs, after parsing the flag
    assert "distributed_executor_backend='uni'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_stacked_expert_checkpoints_load_like_per_expert_ones(models, tmp_path, arch):
    """transformers 5 holds experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H]); a
    checkpoint saved from its state dict loads into the same model as the per-expert one."""
    import shutil

    from safetensors.torch import save_file
    from tiny_models import load_hf

    path, want, _ = models[arch]
    stacked = tmp_path / "stacked"
    shutil.copytree(path, stacked)
    state = {k: v.clone() for k, v in load_hf(path).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    llm = _llm(stacked, tensor_parallel_size=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == want
