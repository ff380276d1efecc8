"""What agent clients send on the Messages route, through the `anthropic` SDK against a
real server: system turns inside `messages`, `context_management` edits, deferred and
typed tools, and `max_tokens` far over the context."""

from __future__ import annotations

import anthropic
import pytest
from conftest import TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app
from tokenmill.server.chat import fold_system

# renders reasoning; refuses a system message anywhere but first (as many real templates)
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System messages must come first') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m.get('reasoning_content') %}<think>"
    "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = [
    {"role": "user", "content": "Hello"},
    {"role": "system", "content": "Environment: linux."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Bye"},
    {"role": "system", "content": "Reminder: be brief."},
]


@pytest.fixture(scope="module")
def strict(tiny_model):
    engine = tiny_engine(tiny_model, chat_template=STRICT_TEMPLATE, num_kv_blocks=512)
    with running_server(build_app(engine, [TINY_NAME])) as url:
        yield url, engine


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def _tokens(engine, template: str, conv) -> int:
    text = engine.tokenizer.apply_chat_template(conv, chat_template=template,
                                                add_generation_prompt=True, tokenize=False)
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def test_system_turns_render_in_place_where_the_template_allows(tiny_server):
    url, engine = tiny_server
    client = _client(url)
    n = client.messages.count_tokens(model=TINY_NAME, messages=TURNS).input_tokens
    assert n == _tokens(engine, engine.chat_template, TURNS)  # in place, not folded
    assert n != _tokens(engine, engine.chat_template, fold_system(TURNS))
    m = client.messages.create(model=TINY_NAME, max_tokens=4, messages=TURNS)
    assert m.stop_reason in ("max_tokens", "end_turn")


def test_system_turns_fold_into_the_system_prompt_otherwise(strict):
    url, engine = strict
    client = _client(url)
    n = client.messages.count_tokens(model=TINY_NAME, system="Be kind.", messages=TURNS)
    folded = fold_system([{"role": "system", "content": "Be kind."}, *TURNS])
    assert folded[0]["content"] == "Be kind.\n\nEnvironment: linux.\n\nReminder: be brief."
    assert n.input_tokens == _tokens(engine, STRICT_TEMPLATE, folded)
    m = client.messages.create(model=TINY_NAME, max_tokens=4, system="Be kind.", messages=TURNS)
    assert m.content[0].type == "text"


def _thinking_turns(k: int) -> list[dict]:
    conv = []
    for i in range(k):
        conv += [{"role": "user", "content": f"Question {i}"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": f"long thoughts number {i}", "signature": ""},
                     {"type": "text", "text": f"Answer {i}"}]}]
    return [*conv, {"role": "user", "content": "Next"}]


def test_clear_thinking_keeps_the_last_turns(strict):
    url, engine = strict
    client, conv = _client(url), _thinking_turns(3)
    counts = {}
    for keep in ("all", 1, None):
        edit = {"type": "clear_thinking_20251015"}
        if keep == "all":
            edit["keep"] = "all"
        elif keep is not None:
            edit["keep"] = {"type": "thinking_turns", "value": keep}
        body = {"context_management": {"edits": [edit]}}
        counts[keep] = client.messages.count_tokens(model=TINY_NAME, messages=conv,
                                                    extra_body=body).input_tokens
        if keep == 1:
            m = client.messages.create(model=TINY_NAME, max_tokens=2, messages=conv,
                                       extra_body=body)
            assert m.model_extra["context_management"] == {"applied_edits": [
                {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2}]}
    hf = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
           else m["content"][1]["text"], **({"reasoning_content": m["content"][0]["thinking"]}
                                            if isinstance(m["content"], list) else {})}
          for m in conv]
    assert counts["all"] == _tokens(engine, STRICT_TEMPLATE, hf)
    for m in hf[:4]:  # the first two assistant turns lose their thinking
        m.pop("reasoning_content", None)
    assert counts[1] == counts[None] == _tokens(engine, STRICT_TEMPLATE, hf) < counts["all"]


def test_clear_tool_uses_past_the_trigger(tiny_server):
    url, _ = tiny_server
    client = _client(url)
    conv = []
    for i in range(3):
        conv += [{"role": "user", "content": f"look {i}"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}",
                                                    "name": "Read", "input": {"path": f"/f{i}"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": "file body " * 4}]}]

    def edit(trigger: int) -> dict:
        return {"context_management": {"edits": [{
            "type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": trigger},
            "keep": {"type": "tool_uses", "value": 1}}]}}

    untouched = client.messages.count_tokens(model=TINY_NAME, messages=conv,
                                             extra_body=edit(1 << 20)).input_tokens
    cleared = client.messages.count_tokens(model=TINY_NAME, messages=conv,
                                           extra_body=edit(0)).input_tokens
    assert cleared < untouched
    m = client.messages.create(model=TINY_NAME, max_tokens=2, messages=conv, extra_body=edit(0))
    assert m.model_extra["context_management"]["applied_edits"] == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2}]


def test_deferred_and_typed_tools_stay_out_of_the_prompt(tiny_server):
    url, _ = tiny_server
    client = _client(url)
    msgs = [{"role": "user", "content": "hi"}]
    read = {"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}
    deferred = {"name": "WebFetch", "description": "fetch a URL " * 20,
                "input_schema": {"type": "object"}, "defer_loading": True}
    typed = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    alone = client.messages.count_tokens(model=TINY_NAME, messages=msgs, tools=[read])
    more = client.messages.count_tokens(model=TINY_NAME, messages=msgs,
                                        tools=[read, deferred, typed])
    assert alone.input_tokens == more.input_tokens
    r = client.messages.create(model=TINY_NAME, max_tokens=2, messages=msgs,
                               tools=[read, deferred, typed])
    assert r.type == "message"
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        client.messages.create(model=TINY_NAME, max_tokens=2, messages=msgs,
                               tools=[{"name": "NoSchema"}])


def test_max_tokens_is_a_cap(tiny_server):
    url, engine = tiny_server
    with _client(url).messages.stream(model=TINY_NAME, max_tokens=32000,
                                      messages=[{"role": "user", "content": "go"}]) as stream:
        m = stream.get_final_message()
    assert engine.max_model_len < 32000
    assert m.usage.input_tokens + m.usage.output_tokens <= engine.max_model_len
