"""Through a real server: requests that leave the sampling fields unset get the model's
generation config (here top_k=1: greedy), over the OpenAI and Anthropic APIs alike, with
the engine core in the server's process and in a process of its own."""

from __future__ import annotations

import json
import shutil

import anthropic
import openai
import pytest
from conftest import TINY_NAME, running_server

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("server-gencfg") / "llama"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1, "eos_token_id": 2}))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "engine-process"])
def base_url(model, request):
    args = EngineArgs(model=str(model), dtype="float32", block_size=4, num_kv_blocks=512)
    engine = AsyncLLM(args, engine_process=request.param)
    try:
        if not request.param:
            assert engine.engine.generation_defaults == {"top_k": 1}
        with running_server(build_app(engine, [TINY_NAME])) as url:
            yield url
    finally:
        engine.shutdown()


def test_unset_sampling_fields_take_the_models_defaults(base_url):
    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    def chat(**kw) -> str:
        r = oa.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=8, **kw)
        return r.choices[0].message.content

    greedy = chat(temperature=0)
    # temperature 1 (given or not) with the config's top_k=1 is still greedy, any seed
    assert [chat(seed=s) for s in range(3)] == [greedy] * 3
    assert chat(temperature=1.0, seed=5) == greedy
    completion = oa.completions.create(model=TINY_NAME, prompt="The quick", max_tokens=8, seed=1)
    greedy_completion = oa.completions.create(
        model=TINY_NAME, prompt="The quick", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text == greedy_completion.choices[0].text

    an = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    m = an.messages.create(model=TINY_NAME, max_tokens=8, messages=MESSAGES)
    g = an.messages.create(model=TINY_NAME, max_tokens=8, messages=MESSAGES,
                           extra_body={"temperature": 0})
    assert m.content[0].text == g.content[0].text
