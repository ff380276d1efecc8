"""An agent's next turn across roles: the prefill engine of turn N+1 finds turn N's KV,
the decode engine's output included, in a shared tier (a real Redis server both engines
offload to) instead of recomputing it; for a hybrid model the recurrent state comes back
as the decode engine's checkpoint at its last block boundary. Every turn computes at most
its new tokens (+ the last sampled token, never fed) + one block; greedy output equals a
colocated conversation's."""

from __future__ import annotations

import pytest
from kv_connector.redis_server import RedisServer

from tokenmill import LLM, SamplingParams
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = pytest.mark.long  # engine pairs or server processes for prefill and decode: minutes

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


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_next_turn_finds_the_decode_side_kv_in_a_shared_tier(arch, tmp_path):
    path = str(make_tiny_model(tmp_path / arch, arch))
    colocated = LLM(path, **KW)
    reference, history = [], []
    for turn in TURNS:
        out = colocated.generate({"prompt_token_ids": history + turn}, GREEDY, use_tqdm=False)
        reference.append(list(out[0].outputs[0].token_ids))
        history = history + turn + reference[-1]
    colocated.engine.shutdown()

    server = RedisServer(tmp_path).start()
    shared = dict(kv_offload_remote=server.url, kv_transport="mooncake")
    prefill = LLM(path, kv_role="prefill", **KW, **shared).engine
    decode = LLM(path, kv_role="decode", **KW, **shared).engine
    try:
        history = []
        for i, turn in enumerate(TURNS):
            prompt = history + turn
            prefill.add_request(f"p{i}", prompt, GREEDY, handover_out=True)
            offered = _run(prefill)[f"p{i}"]
            decode.add_request(f"d{i}", prompt, GREEDY, handover_in=HandoverIn(
                offered.kv_offer, prefill.handover.endpoint()))
            output = list(_run(decode)[f"d{i}"].outputs[0].token_ids)
            prefill.release_handover([f"p{i}"])
            decode.offload.worker_side.drain()  # its saves are in the tier (written behind)
            assert output == reference[i]
            computed = len(prompt) - offered.num_cached_tokens
            assert computed <= len(turn) + (1 if i else 0) + BS
            if i:  # blocks holding the decode engine's output came back through the tier
                assert offered.num_cached_tokens > len(history) - len(reference[i - 1])
            history = prompt + output
    finally:
        prefill.shutdown()
        decode.shutdown()
        server.kill()
