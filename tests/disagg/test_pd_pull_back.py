"""An agent's next turn pulls turn N's KV back from the decode engine that holds it, with
no shared tier: the decode engine leases the longest prefix of the next prompt its prefix
cache serves (turn N's prompt and output, a recurrent group's checkpoint at the boundary),
the prefill engine of turn N+1 pulls what its own cache lacks and computes only the rest.
Every turn computes at most its new tokens (+ the last sampled token, never fed) + one
block; greedy output equals a colocated conversation's; the lease goes back."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill_conformance.tiny_models import make_tiny_model

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", block_size=BS, max_num_batched_tokens=32, num_kv_blocks=256)
TURNS = [[(3 * j) % 200 + 9 for j in range(18)], [201, 202, 203, 204, 205],
         [150, 151, 152, 153, 154, 155, 156]]


def _run(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def _colocated(path: str) -> list[list[int]]:
    colocated = LLM(path, **KW)
    reference, history = [], []
    for turn in TURNS:
        out = colocated.generate({"prompt_token_ids": history + turn}, GREEDY, use_tqdm=False)
        reference.append(list(out[0].outputs[0].token_ids))
        history = history + turn + reference[-1]
    colocated.engine.shutdown()
    return reference


@pytest.mark.long  # engine pairs, three turns: half a minute to a minute each
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_next_turn_pulls_turn_n_back_from_the_decode_engine(arch, tmp_path):
    path = str(make_tiny_model(tmp_path / arch, arch))
    reference = _colocated(path)
    prefill = LLM(path, kv_role="prefill", kv_transport="mooncake", **KW).engine
    decode = LLM(path, kv_role="decode", kv_transport="mooncake", **KW).engine
    try:
        history = []
        for i, turn in enumerate(TURNS):
            prompt = history + turn
            back = decode.handover.offer_prefix(f"back{i}", prompt) if i else None
            if i:  # turn N's prompt and output, up to the last full block before the new turn
                assert back is not None and back.prefix
                assert back.num_tokens >= (len(history) - 1) // BS * BS
                assert decode.handover.stats().leases_held == 1
            prefill.add_request(f"p{i}", prompt, GREEDY, handover_out=True, handover_in=(
                None if back is None else HandoverIn(back, decode.handover.endpoint())))
            offered = _run(prefill)[f"p{i}"]
            if i:
                assert prefill.handover.stats().received == i  # pulled, not recomputed
                assert decode.release_handover([f"back{i}"]) == 1
            decode.add_request(f"d{i}", prompt, GREEDY, handover_in=HandoverIn(
                offered.kv_offer, prefill.handover.endpoint()))
            output = list(_run(decode)[f"d{i}"].outputs[0].token_ids)
            assert prefill.release_handover([f"p{i}"]) == 1
            assert output == reference[i]
            computed = len(prompt) - offered.num_cached_tokens
            assert computed <= len(turn) + (1 if i else 0) + BS
            if i:  # blocks holding the decode engine's output came back from it
                assert offered.num_cached_tokens > len(history) - len(reference[i - 1])
            history = prompt + output
        assert decode.handover.stats().leases_held == 0
        assert prefill.handover.stats().blocks_pulled > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefix_offer_for_another_prompt_is_refused(tmp_path):
    path = str(make_tiny_model(tmp_path / "llama", "llama"))
    prefill = LLM(path, kv_role="prefill", kv_transport="mooncake", **KW).engine
    decode = LLM(path, kv_role="decode", kv_transport="mooncake", **KW).engine
    try:
        prompt = TURNS[0]
        decode.add_request("d", prompt, GREEDY)
        _run(decode)
        assert decode.handover.offer_prefix("none", [7] * 12) is None  # nothing cached
        back = decode.handover.offer_prefix("back", prompt + [5, 6])
        assert back is not None and back.num_tokens % BS == 0
        with pytest.raises(ValueError, match="not a proper prefix"):
            prefill.add_request("p", [1] + prompt, GREEDY, handover_out=True,
                                handover_in=HandoverIn(back, decode.handover.endpoint()))
        with pytest.raises(ValueError, match="already in use"):
            decode.handover.offer_prefix("back", prompt + [5, 6])
        assert decode.release_handover(["back"]) == 1
    finally:
        prefill.shutdown()
        decode.shutdown()
