"""Generation defaults as vLLM's `--generation-config auto`: what the model's
generation_config.json says applies to the sampling fields a request leaves unset;
explicit values win; 'vllm' / 'none' turn it off."""

import json
import logging
import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.model.generation_config import SHIPPED, load_generation_defaults
from tokenmill.sampling_params import NEUTRAL_DEFAULTS

PROMPT = "The quick brown fox"


def with_generation_config(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def top_k_1_model(tiny_dirs, tmp_path_factory):
    """The tiny llama whose generation config samples with top_k=1: greedy, whatever the
    temperature, so a request that leaves top_k unset must give the greedy tokens."""
    dst = tmp_path_factory.mktemp("gencfg") / "llama"
    return with_generation_config(tiny_dirs["llama"], dst, {"top_k": 1, "eos_token_id": 2})


def test_unset_fields_take_defaults_and_set_fields_win():
    p = SamplingParams(temperature=0.7, top_k=-1)
    assert p.unset_fields == ("top_p", "min_p", "repetition_penalty")
    filled = p.with_defaults({"temperature": 0.2, "top_p": 0.9, "top_k": 40})
    assert (filled.temperature, filled.top_p, filled.top_k) == (0.7, 0.9, 0)  # -1 is set: off
    assert (filled.min_p, filled.repetition_penalty) == (0.0, 1.0)  # neutral where none given
    assert filled.unset_fields == () and filled.with_defaults({"top_p": 0.5}) is filled
    plain = SamplingParams().with_defaults()
    assert [getattr(plain, k) for k in NEUTRAL_DEFAULTS] == list(NEUTRAL_DEFAULTS.values())
    assert not SamplingParams().greedy and SamplingParams(temperature=0).greedy
    with pytest.raises(ValueError, match=r"SamplingParams.top_p=0: must be in \(0, 1\]"):
        SamplingParams(top_p=0)


def test_defaults_come_from_generation_config_or_the_shipped_table(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
         "max_new_tokens": 99, "min_p": None}
    ))
    defaults, source = load_generation_defaults(str(hf))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert source == str(hf / "generation_config.json")
    for off in ("vllm", "none"):
        assert load_generation_defaults(str(hf), off)[0] == {}
    # a GGUF reads the generation config beside it, else what tokenmill ships for it
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    default_model = gguf / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert load_generation_defaults(str(default_model))[0] == {"temperature": 0.2, "top_p": 0.9}
    assert load_generation_defaults(str(default_model))[0] == SHIPPED[default_model.name]
    assert load_generation_defaults(str(gguf / "other.gguf")) == ({}, "no generation config")
    assert load_generation_defaults(str(default_model), str(hf))[0]["top_k"] == 20
    shutil.copy(hf / "generation_config.json", gguf)
    assert load_generation_defaults(str(default_model))[0]["temperature"] == 0.6
    # bad values name the file
    (hf / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.top_p=1.5"):
        load_generation_defaults(str(hf))
    with pytest.raises(ValueError, match="generation_config='nowhere' must be 'auto'"):
        EngineArgs(generation_config="nowhere")


def test_llm_applies_the_models_defaults_unless_told_not_to(top_k_1_model, caplog):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        llm = LLM(str(top_k_1_model), dtype="float32", block_size=4)
    assert "generation_config.json): top_k=1" in caplog.text
    want = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # seeds change nothing: top_k=1 from the generation config leaves one candidate
    unset = [SamplingParams(max_tokens=8, ignore_eos=True, seed=s) for s in range(4)]
    outs = llm.generate([PROMPT] * 4, unset, use_tqdm=False)
    assert all(o.outputs[0].token_ids == want for o in outs)
    # what the sampler gets: the request's unset fields filled, its own kept
    llm.engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0.5, max_tokens=2))
    params = llm.engine.scheduler.requests["probe"].sampling_params
    assert (params.top_k, params.temperature, params.top_p) == (1, 0.5, 1.0)
    llm.engine.abort_request("probe")

    off = LLM(str(top_k_1_model), dtype="float32", block_size=4, generation_config="vllm")
    assert off.engine.generation_defaults == {}
    off.engine.add_request("probe", [5, 6, 7], SamplingParams(max_tokens=2))
    params = off.engine.scheduler.requests["probe"].sampling_params
    assert [getattr(params, k) for k in NEUTRAL_DEFAULTS] == list(NEUTRAL_DEFAULTS.values())
    off.engine.abort_request("probe")


def test_serve_refuses_a_bad_generation_config(capsys):
    from tokenmill.server.cli import main

    assert main(["serve", "--generation-config", "nowhere", "--port", "1"]) == 2
    assert "generation_config='nowhere' must be 'auto', 'vllm', 'none'" in capsys.readouterr().err
