"""Sleep mode over HTTP (POST /sleep?level=, POST /wake_up, GET /is_sleeping) on a real
uvicorn server with the real openai SDK, with the engine core in this process and in a
process of its own (what `tokenmill serve` runs): greedy completions identical before the
sleep and after the wake, requests while asleep answered 503 in OpenAI's error shape,
refused changes 409, a bad level 400."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server

from tokenmill.async_engine import AsyncLLM
from tokenmill.config import EngineArgs
from tokenmill.server.app import build_app

ENGINE_KW = {"dtype": "float32", "block_size": 4, "max_num_seqs": 8, "num_kv_blocks": 256,
             "platform": "cpu"}
PROMPTS = ["The quick brown fox", "def main():", "Paris is"]


def _completions(client: openai.OpenAI) -> list[str]:
    return [client.completions.create(model=TINY_NAME, prompt=p, max_tokens=8, temperature=0)
            .choices[0].text for p in PROMPTS]


def _sleeping(http: httpx.Client) -> bool:
    response = http.get("/is_sleeping")
    assert response.status_code == 200
    return response.json()["is_sleeping"]


@pytest.mark.parametrize("engine_process,levels", [(False, [1]), (True, [1, 2])],
                         ids=["in_process", "engine_process"])
def test_sleep_and_wake_over_http(tiny_model, engine_process, levels):
    engine = AsyncLLM(EngineArgs(model=str(tiny_model), **ENGINE_KW),
                      engine_process=engine_process)
    with running_server(build_app(engine, [TINY_NAME])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with httpx.Client(base_url=url, timeout=120) as http:
            before = _completions(client)
            assert not _sleeping(http)
            for level in levels:
                assert http.post("/sleep", params={"level": level}).status_code == 200
                assert _sleeping(http)
                with pytest.raises(openai.APIStatusError) as refused:
                    client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
                assert refused.value.status_code == 503
                assert "asleep" in refused.value.body["message"]
                again = http.post("/sleep", params={"level": level})
                assert again.status_code == 409 and "already asleep" in again.json()["error"][
                    "message"]
                assert http.post("/wake_up").status_code == 200
                assert not _sleeping(http)
                assert _completions(client) == before, f"outputs changed over level {level}"
            bad = http.post("/sleep", params={"level": 3})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
            awake = http.post("/wake_up")
            assert awake.status_code == 409 and "not asleep" in awake.json()["error"]["message"]
            assert _completions(client) == before
