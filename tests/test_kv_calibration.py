"""Calibrated FP8 KV scales (`calculate_kv_scales`, docs/quantized-kv.md): the scales a
tiny llama calibrates to against amax / 448 of transformers' own cached keys and values on
the same sample; calibrated FP8 against scales of 1.0 on a model whose KV is small; the
option with an unquantized cache; the fingerprint and handshake that name the scales."""

from __future__ import annotations

import logging
import math

import msgspec
import pytest
import torch
from tiny_models import load_hf

from tokenmill import LLM, SamplingParams
from tokenmill.engine.kv_calibration import CALIBRATION_TOKENS, calibration_text
from tokenmill.kv_connector.objects import KVLayout
from tokenmill.model.kv_scales import quantized_kv_layers
from tokenmill.platforms.kv_handover import EngineEndpoint, compatibility_problems
from tokenmill.platforms.ops.kv_quant import calibrated_scales

E4M3_MAX = 448.0


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.executor.worker.runner.model


def _hf_cache(path, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' cached (post-rotary) keys and values per layer, [kv_heads, T, dim]."""
    model = load_hf(path)
    with torch.no_grad():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_calibrated_scales_are_the_amax_per_head_of_the_hf_keys_and_values(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", platform="cpu", kv_cache_dtype="fp8",
              calculate_kv_scales=True, num_kv_blocks=64)
    try:
        ids = list(llm.engine.config.kv_calibration_token_ids)
        most = min(CALIBRATION_TOKENS, llm.engine.max_model_len)  # the tiny model's: 512
        assert ids == llm.get_tokenizer().encode(calibration_text())[:most]
        layers = quantized_kv_layers(_model(llm))
        hf = _hf_cache(tiny_llama, ids)
        assert len(layers) == len(hf)
        for layer, (keys, values) in zip(layers, hf, strict=True):
            k_amax = keys.abs().amax(dim=(1, 2))  # per KV head, over tokens and dims
            v_amax = values.abs().amax(dim=(1, 2))
            torch.testing.assert_close(layer.k_scale, k_amax / E4M3_MAX, rtol=1e-4, atol=0)
            torch.testing.assert_close(layer.v_scale, v_amax / E4M3_MAX, rtol=1e-4, atol=0)
            assert not torch.equal(layer.k_scale, torch.ones_like(layer.k_scale))
        # the calibrated engine runs and its pool holds FP8 pages
        out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def test_mla_calibrates_one_scale_for_the_latent_row(tmp_path):
    """A tiny DeepSeek-V3 (MLA) on the cpu plugin's MLA backend: each layer's one k_scale
    is amax / 448 of the latent row it caches (c_kv after kv_a_layernorm | the roped k_pe),
    from transformers' cache, which holds exactly those two parts (keys: c_kv, values:
    k_pe)."""
    from test_deepseek_v3 import save_tiny, tiny_config
    from transformers import AutoModelForCausalLM

    from tokenmill_conformance.tiny_models import make_tokenizer

    tokenizer = make_tokenizer(300)
    config = tiny_config(len(tokenizer))
    save_tiny(tmp_path, config, tokenizer)
    llm = LLM(str(tmp_path), dtype="float32", platform="cpu", block_size=4,
              kv_cache_dtype="fp8", calculate_kv_scales=True, max_num_batched_tokens=64,
              num_kv_blocks=64)
    try:
        ids = list(llm.engine.config.kv_calibration_token_ids)
        assert len(ids) == 64  # one step of max_num_batched_tokens
        layers = quantized_kv_layers(_model(llm))
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    assert len(layers) == len(cache.layers) == config.num_hidden_layers
    for layer, hf_layer in zip(layers, cache.layers, strict=True):
        c_kv, k_pe = hf_layer.keys[0], hf_layer.values[0]  # [1, T, rank], [1, T, rope]
        assert c_kv.shape[-1] == config.kv_lora_rank
        assert k_pe.shape[-1] == config.qk_rope_head_dim
        amax = torch.maximum(c_kv.abs().max(), k_pe.abs().max())
        assert layer.k_scale.shape == (1,)
        torch.testing.assert_close(layer.k_scale, (amax / E4M3_MAX).view(1), rtol=1e-4, atol=0)


def test_scales_have_a_floor_and_refuse_an_unquantized_dtype():
    amax = torch.tensor([0.0, 4.48, 896.0])
    scales = calibrated_scales(amax, torch.float8_e4m3fn)
    assert scales[0] > 0 and scales[1:].tolist() == pytest.approx([0.01, 2.0])
    assert calibrated_scales(torch.tensor([57344.0]), torch.float8_e5m2).item() == 1.0
    with pytest.raises(ValueError, match="bfloat16"):
        calibrated_scales(amax, torch.bfloat16)
    with pytest.raises(ValueError, match="inf"):
        calibrated_scales(torch.tensor([math.inf]), torch.float8_e4m3fn)


SHRINK = 1e-3  # the small-KV model's keys and values, times the original model's


@pytest.fixture(scope="module")
def small_kv_llama(tiny_dirs, tmp_path_factory):
    """The tiny llama with keys and values SHRINK times as large and the same function in
    exact arithmetic: k_proj and v_proj times SHRINK, q_proj and o_proj divided by it (the
    logits q.k and the output o(v) are unchanged; rotary is linear). Its keys lie in e4m3's
    subnormals at scale 1.0 (below 2^-6)."""
    model = load_hf(tiny_dirs["llama"])
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.mul_(SHRINK)
            attn.v_proj.weight.mul_(SHRINK)
            attn.q_proj.weight.div_(SHRINK)
            attn.o_proj.weight.div_(SHRINK)
    path = tmp_path_factory.mktemp("small_kv") / "llama"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_dirs["llama"]).save_pretrained(path)
    return path


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    return torch.tensor([pos[t].logprob for t, pos in zip(ids[1:], out.prompt_logprobs[1:],
                                                          strict=True)])


def _logprob_error(path, calibrate: bool, ids: list[int]) -> float:
    """Mean |tokenmill's FP8-KV log-probability - transformers' float32 one| over the
    tokens of `ids` (prefill in chunks of 16: later chunks read earlier keys back from the
    FP8 cache)."""
    llm = LLM(str(path), dtype="float32", platform="cpu", kv_cache_dtype="fp8",
              calculate_kv_scales=calibrate, num_kv_blocks=64, max_num_batched_tokens=16,
              max_model_len=256)
    try:
        got = _prompt_logprobs(llm, ids)
        scales = quantized_kv_layers(_model(llm))[0].k_scale
        assert (scales != 1.0).all() if calibrate else (scales == 1.0).all()
    finally:
        llm.engine.shutdown()
    with torch.no_grad():
        logits = load_hf(path)(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    want = logits.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return (got - want).abs().mean().item()


def test_calibrated_fp8_is_closer_to_the_reference_than_unit_scales_on_small_kv(
    small_kv_llama, tiny_llama
):
    """Against transformers' log-probabilities of a prompt's tokens: on the small-KV model,
    scales of 1.0 round its keys and values into e4m3's subnormals and lose them;
    calibrated scales bring the error back to what FP8 costs the original model (whose
    keys and values are of order 1, where 1.0 is a fine scale)."""
    from transformers import AutoTokenizer

    text = "the quick brown fox jumps over the lazy dog while counting tokens " * 3
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(text)[:96]
    baseline = _logprob_error(tiny_llama, False, ids)  # FP8's own cost, at sound scales
    unit = _logprob_error(small_kv_llama, False, ids)
    calibrated = _logprob_error(small_kv_llama, True, ids)
    print(f"FP8 KV logprob error: original model, scales 1.0 {baseline:.4f}; small KV, "
          f"scales 1.0 {unit:.4f}, calibrated {calibrated:.4f}")
    assert unit > 4 * calibrated
    assert calibrated < 2 * baseline + 1e-3


def test_calculate_kv_scales_without_a_quantized_cache_is_a_logged_no_op(tiny_llama, caplog):
    """As in vLLM, the option is accepted with kv_cache_dtype 'auto' and does nothing; we
    say so in a warning."""
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.kv_calibration"):
        llm = LLM(str(tiny_llama), dtype="float32", platform="cpu", kv_cache_dtype="auto",
                  calculate_kv_scales=True, num_kv_blocks=16)
    try:
        assert llm.engine.config.kv_calibration_token_ids == ()
        assert quantized_kv_layers(_model(llm)) == []
        assert "calculate_kv_scales is ignored: kv_cache_dtype is 'auto'" in caplog.text
    finally:
        llm.engine.shutdown()


def test_calibrated_scales_enter_the_offload_fingerprint_and_the_handshake():
    layout = KVLayout("m", "float8_e4m3fn", 16, ((2, 64),), 1)
    calibrated = KVLayout("m", "float8_e4m3fn", 16, ((2, 64),), 1, kv_scales="ab12")
    other = KVLayout("m", "float8_e4m3fn", 16, ((2, 64),), 1, kv_scales="cd34")
    assert len({layout.fingerprint(), calibrated.fingerprint(), other.fingerprint()}) == 3
    mine = EngineEndpoint("d", "nixl", "m", "bfloat16", 16, "l", 1, [], "float8_e4m3fn", "ab12")
    peer = msgspec.structs.replace(mine, engine_id="p", kv_scales="")
    (problem,) = compatibility_problems(mine, peer)
    assert "kv_scales: '' on p, 'ab12' here" in problem
    assert compatibility_problems(mine, msgspec.structs.replace(mine, engine_id="p")) == []


@pytest.fixture
def tiny_llama(tiny_dirs):
    return tiny_dirs["llama"]
