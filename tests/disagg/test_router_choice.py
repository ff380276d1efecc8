"""The router's choice of instance: a conversation's next turn goes where its KV is
(prefix affinity keyed by its start), else to the instance with the fewest requests in
flight; an instance that failed goes last until it serves again; requests a handover
cannot cover go to a decode instance whole."""

from __future__ import annotations

from tokenmill.server.router import Instance, Pool, affinity_key, handover_applies


def test_affinity_then_load_then_failures():
    a, b, c = Instance("http://a"), Instance("http://b"), Instance("http://c")
    pool = Pool([a, b, c])
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert [i.url for i in pool.order(None)] == ["http://b", "http://c", "http://a"]
    pool.served("session-1", a)
    assert pool.order("session-1")[0] is a  # where its KV is, though the busiest
    assert pool.order("session-2")[0] is b
    a.failures = 1  # failed since: the affinity yields, and it sorts last
    assert [i.url for i in pool.order("session-1")] == ["http://b", "http://c", "http://a"]
    pool.served("session-1", a)
    assert a.failures == 0 and pool.order("session-1")[0] is a


def test_affinity_key_is_the_conversation_start():
    first = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    later = {"messages": [*first["messages"], {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "next"}]}
    other = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "v"}]}
    chat = "/v1/chat/completions"
    assert affinity_key(chat, first) == affinity_key(chat, later) != affinity_key(chat, other)
    assert affinity_key("/v1/messages", {"system": "s", "messages": later["messages"]}) == (
        affinity_key("/v1/messages", {"system": "s", "messages": first["messages"]}))
    long = "x" * 600
    assert affinity_key("/v1/completions", {"prompt": long}) == affinity_key(
        "/v1/completions", {"prompt": long[:512] + "y"})
    ids = list(range(600))
    assert affinity_key("/v1/completions", {"prompt": ids}) == affinity_key(
        "/v1/completions", {"prompt": ids[:512] + [7]}) != affinity_key(
        "/v1/completions", {"prompt": [1, 2, 3]})
    assert affinity_key("/v1/completions", {}) is None


def test_what_a_handover_covers():
    assert handover_applies("/v1/chat/completions", {"messages": []})
    assert not handover_applies("/v1/chat/completions", {"n": 2})
    assert not handover_applies("/v1/completions", {"best_of": 3})
    assert not handover_applies("/v1/responses", {"previous_response_id": "resp_1"})
    assert handover_applies("/v1/responses", {"input": "hi"})
