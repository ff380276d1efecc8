"""Sleep mode over HTTP (POST /sleep?level=, POST /wake_up, GET /is_sleeping) on a real
uvicorn server with the real openai SDK, with the engine core in this process and in a
process of its own (what `tokenmill serve` runs): greedy completions identical before the
sleep and after the wake, requests while asleep answered 503 in OpenAI's error shape,
refused changes 409, a bad level 400. The routes exist only with `--enable-sleep-mode` and
answer only the admin key: none is a 401, a client key a 403."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app
from tokenmill.server.cli import main

ENGINE_KW = {"dtype": "float32", "block_size": 4, "max_num_seqs": 8, "num_kv_blocks": 256,
             "platform": "cpu"}
PROMPTS = ["The quick brown fox", "def main():", "Paris is"]
ADMIN, CLIENT = "sk-admin", "sk-client"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


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
    app = build_app(engine, [TINY_NAME], enable_sleep_mode=True, admin_api_key=ADMIN)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with httpx.Client(base_url=url, timeout=120, headers=AS_ADMIN) as http:
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


def test_sleep_routes_are_off_unless_enabled(tiny_server):
    url, _ = tiny_server
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert httpx.request(method, f"{url}{path}", headers=AS_ADMIN).status_code == 404


def test_sleep_routes_need_the_admin_key(tiny_model):
    engine = AsyncLLM(EngineArgs(model=str(tiny_model), **ENGINE_KW))
    app = build_app(engine, [TINY_NAME], api_key=CLIENT, enable_sleep_mode=True,
                    admin_api_key=ADMIN)
    with running_server(app) as url:
        for path in ("/is_sleeping", "/%69s_sleeping"):  # an escaped spelling is no way around
            assert httpx.get(f"{url}{path}").status_code == 401
            assert httpx.get(f"{url}{path}", headers={"x-api-key": "wrong"}).status_code == 401
            forbidden = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {CLIENT}"})
            assert forbidden.status_code == 403
            assert forbidden.json()["error"]["type"] == "permission_error"
            assert "admin key" in forbidden.json()["error"]["message"]
            assert httpx.get(f"{url}{path}", headers={"x-api-key": ADMIN}).json() == {
                "is_sleeping": False}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=CLIENT, max_retries=0)
        with pytest.raises(openai.PermissionDeniedError):
            client.post("/../sleep", cast_to=httpx.Response)
        assert httpx.post(f"{url}/sleep", headers={"x-api-key": CLIENT}).status_code == 403
        # the admin key is not a client key
        assert httpx.get(f"{url}/v1/models", headers=AS_ADMIN).status_code == 401
        assert client.models.list().data[0].id == TINY_NAME


def test_sleep_mode_without_an_admin_key_refuses_to_start(tiny_model, capsys, monkeypatch):
    engine = AsyncLLM(EngineArgs(model=str(tiny_model), **ENGINE_KW))
    with pytest.raises(ValueError, match="--admin-api-key"):
        build_app(engine, [TINY_NAME], enable_sleep_mode=True)
    monkeypatch.delenv("TOKENMILL_ADMIN_API_KEY", raising=False)
    assert main(["serve", str(tiny_model), "--enable-sleep-mode", "--port", "1"]) == 2
    assert "--enable-sleep-mode needs --admin-api-key" in capsys.readouterr().err
