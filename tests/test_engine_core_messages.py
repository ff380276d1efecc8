"""What crosses between the engine core and its frontend: every message round-trips through
msgpack with every field, and decoding re-validates what it builds."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.frontend.outputs import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    SchedulerStats,
)
from tokenmill.platforms.step import Logprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputsParams

ENC = msgspec.msgpack.Encoder()


def roundtrip(message, union):
    return msgspec.msgpack.Decoder(union).decode(ENC.encode(message))


def test_a_request_with_every_field_roundtrips():
    params = SamplingParams(
        n=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=3, stop=["\n\n", "END"],
        stop_token_ids=[7, 9], include_stop_str_in_output=True, ignore_eos=True, max_tokens=40,
        min_tokens=2, logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        eos_token_ids=frozenset({0, 2}),
    )
    request = EngineCoreRequest("r#1", [1, 2, 3], params, cache_salt="tenant")
    back = roundtrip(request, EngineCoreInput)
    assert back == request and back.params == params
    for message in (EngineCoreAbort(["a", "b"]), EngineCoreShutdown()):
        assert roundtrip(message, EngineCoreInput) == message


def test_decoding_revalidates_sampling_params():
    raw = ENC.encode(EngineCoreRequest("r", [1], SamplingParams()))
    bad = raw.replace(b"\xa1n\x01", b"\xa1n\x00")  # n = 0
    with pytest.raises(msgspec.ValidationError, match="n=0"):
        msgspec.msgpack.Decoder(EngineCoreInput).decode(bad)


def test_outputs_with_every_field_roundtrip():
    lp = Logprobs(token_ids=[5, 6], logprobs=[-0.1, -2.5], ranks=[1, 2])
    delta = EngineCoreOutput(
        "r", new_token_ids=[5], new_logprobs=[lp], new_prompt_logprobs=[lp, lp],
        finish_reason="stop", stop_reason=9, num_cached_tokens=16, add_error=None,
    )
    failed = EngineCoreOutput("x", finish_reason="error", stop_reason="too long", add_error="value")
    stats = SchedulerStats(2, 1, 4, 0.25, 100, 64)
    for message in (
        EngineCoreOutputs([delta, failed], stats),
        EngineCoreOutputs([]),
        EngineCoreReady(256, 1000, [0, 2], "{{ messages }}"),
        EngineCoreDead("the engine failed: RuntimeError('x')"),
    ):
        assert roundtrip(message, EngineCoreMessage) == message


@settings(max_examples=60, deadline=None)
@given(
    new_token_ids=st.lists(st.integers(0, 50_000), max_size=4),
    finish=st.sampled_from([None, "stop", "length", "abort", "error"]),
    stop_reason=st.one_of(st.none(), st.integers(0, 100), st.text(max_size=8)),
    cached=st.integers(-1, 4096),
)
def test_any_delta_roundtrips(new_token_ids, finish, stop_reason, cached):
    delta = EngineCoreOutput("seq", new_token_ids=new_token_ids, finish_reason=finish,
                             stop_reason=stop_reason, num_cached_tokens=cached)
    assert roundtrip(EngineCoreOutputs([delta]), EngineCoreMessage).outputs == [delta]
