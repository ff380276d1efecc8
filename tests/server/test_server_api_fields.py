"""Request fields that change the output, through the real SDKs on a tiny random model:
Anthropic 2.x `output_config` (JSON that validates, for several schemas), `effort`,
top-level `cache_control`; OpenAI `logit_bias`; vLLM's `structured_outputs` extra; and
unknown fields logged instead of silently dropped."""

from __future__ import annotations

import json
import logging
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app

ASK = [{"role": "user", "content": "Answer in JSON"}]
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
     "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["ok", "n", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                      "pos": {"type": "object", "properties": {
                                          "x": {"type": "integer", "minimum": -5, "maximum": 5}},
                                          "required": ["x"], "additionalProperties": False}},
     "required": ["kind", "pos"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def compact_url(tiny_model):
    """A server whose forced JSON has no optional whitespace (the random model otherwise
    writes whitespace until max_tokens)."""
    engine = tiny_engine(tiny_model, num_kv_blocks=512)
    with running_server(build_app(engine, [TINY_NAME], compact_json=True)) as url:
        yield url


@pytest.fixture(scope="module")
def an_compact(compact_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=compact_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def an(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oa(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["string", "mixed", "nested"])
def test_anthropic_output_config_json_validates(an_compact, schema):
    an = an_compact
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    m = an.messages.create(model=TINY_NAME, max_tokens=80, messages=ASK, output_config=fmt,
                           extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn", m.content[0].text
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with an.messages.stream(model=TINY_NAME, max_tokens=80, messages=ASK, output_config=fmt,
                            extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == m.content[0].text


def test_anthropic_effort_and_cache_control_are_accepted(an):
    plain = an.messages.create(model=TINY_NAME, max_tokens=6, messages=ASK,
                               extra_body={"temperature": 0})
    m = an.messages.create(model=TINY_NAME, max_tokens=6, messages=ASK,
                           output_config={"effort": "low"},
                           cache_control={"type": "ephemeral", "ttl": "5m"},
                           extra_body={"temperature": 0})
    assert m.content[0].text == plain.content[0].text  # the tiny template reads neither
    assert m.id.startswith("msg_") and m.id != plain.id
    assert m.usage.cache_read_input_tokens > 0  # the same prompt again: a prefix-cache hit


def test_anthropic_output_config_errors(an):
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model=TINY_NAME, max_tokens=6, messages=ASK,
                           output_config={"format": {"type": "json_schema",
                                                     "schema": {"type": "nonsense"}}})
    with pytest.raises(anthropic.BadRequestError, match="cannot be combined"):
        an.messages.create(
            model=TINY_NAME, max_tokens=6, messages=ASK,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "f"},
            output_config={"format": {"type": "json_schema", "schema": SCHEMAS[0]}})


def test_logit_bias_steers_and_bans(oa, base_url):
    kw = dict(model=TINY_NAME, prompt="Paris is", max_tokens=6, temperature=0)
    plain = oa.completions.create(logprobs=0, **kw).choices[0]
    # an ordinary (ASCII) token: +100 makes it the greedy choice at every step
    forced = httpx.post(f"{base_url}/tokenize", json={"prompt": "quick",
                                                      "add_special_tokens": False}).json()["tokens"][0]
    as_text = httpx.post(f"{base_url}/detokenize", json={"tokens": [forced] * 6}).json()["prompt"]
    r = oa.completions.create(logit_bias={str(forced): 100}, **kw).choices[0]
    assert r.text == as_text
    chat = oa.chat.completions.create(model=TINY_NAME, messages=ASK, max_tokens=6, temperature=0,
                                      logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == as_text
    # -100 on the plain answer's first token: the answer starts otherwise
    first = httpx.post(f"{base_url}/tokenize", json={"prompt": plain.text,
                                                     "add_special_tokens": False}).json()
    banned = oa.completions.create(logit_bias={str(first["tokens"][0]): -100}, **kw).choices[0]
    assert banned.text != plain.text


@pytest.mark.parametrize("bias", [{"999999": 1}, {"-1": 1}, {"abc": 1}, {"5": 101}, {"5": -100.5},
                                  {"²": 1}, {" 5": 1}, {"": 1}])
def test_logit_bias_errors(oa, bias):
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=TINY_NAME, prompt="x", max_tokens=2, logit_bias=bias)
    assert "logit_bias" in str(e.value)


@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"json": SCHEMAS[1], "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) is None),
    ({"grammar": 'start: "north" | "south"'}, lambda t: t in ("north", "south")),
])
def test_structured_outputs_extra(oa, constraint, check):
    c = oa.completions.create(model=TINY_NAME, prompt="Pick:", max_tokens=60, temperature=0,
                              extra_body={"structured_outputs": constraint})
    assert check(c.choices[0].text), c.choices[0].text
    chat = oa.chat.completions.create(model=TINY_NAME, messages=ASK, max_tokens=60, temperature=0,
                                      extra_body={"structured_outputs": constraint})
    assert check(chat.choices[0].message.content), chat.choices[0].message.content


def test_structured_outputs_errors(oa):
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"grammar": "not a grammar ::"}):
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=TINY_NAME, prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": bad})
        assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        oa.chat.completions.create(model=TINY_NAME, messages=ASK, max_tokens=2,
                                   response_format={"type": "json_object"},
                                   extra_body={"structured_outputs": {"regex": "a"}})


def test_unknown_fields_are_logged(oa, an, caplog):
    caplog.set_level(logging.WARNING, logger="tokenmill.server")
    oa.chat.completions.create(model=TINY_NAME, messages=ASK, max_tokens=2,
                               extra_body={"guided_wibble": 1, "frobnicate": True})
    assert ("The following fields were present in the request but ignored: "
            "['frobnicate', 'guided_wibble']") in caplog.text
    caplog.clear()
    an.messages.create(model=TINY_NAME, max_tokens=2, messages=ASK, extra_body={"zzz": 1})
    assert "ignored: ['zzz']" in caplog.text
    caplog.clear()
    oa.responses.create(model=TINY_NAME, input="x", max_output_tokens=2,
                        extra_body={"background_magic": 1})
    assert "ignored: ['background_magic']" in caplog.text
