"""The handshake: a decode engine refuses a prefill engine whose model, dtype, block size,
KV layout or transport differ from its own, naming each mismatch (and nothing is queued);
another tensor parallel size only where the pages cannot be resharded
(test_reshard_plan.py; here: endpoints that do not describe their pages). Different
block sizes are refused, not converted."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill.platforms.kv_handover import EngineEndpoint, compatibility_problems
from tokenmill_conformance.tiny_models import make_tiny_model

BASE = dict(engine_id="a", transport="nixl", model="m1", dtype="float32", block_size=16,
            layout="L1", tensor_parallel_size=1, ranks=[])


@pytest.mark.parametrize("field,other", [
    ("model", "m2"), ("dtype", "bfloat16"), ("block_size", 32), ("layout", "L2"),
    ("tensor_parallel_size", 2), ("transport", "mooncake"),
])
def test_each_mismatch_is_named(field, other):
    mine = EngineEndpoint(**BASE)
    peer = EngineEndpoint(**{**BASE, "engine_id": "b", field: other})
    assert compatibility_problems(mine, mine) == []
    [problem] = compatibility_problems(mine, peer)
    assert problem.startswith(f"{field}: {other!r} on b, {BASE[field]!r} here")


def _offer(prefill):
    """Prefill a 13-token prompt for handover: (prompt, params, the offer it ends with)."""
    prompt = list(range(5, 18))
    params = SamplingParams(temperature=0, max_tokens=4)
    prefill.add_request("p", prompt, params, handover_out=True)
    offer = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            offer = out.kv_offer or offer
    return prompt, params, offer


def test_a_decode_engine_refuses_another_block_size(tmp_path):
    path = str(make_tiny_model(tmp_path / "llama", "llama"))
    kw = dict(dtype="float32", num_kv_blocks=64, kv_transport="mooncake")
    prefill = LLM(path, kv_role="prefill", block_size=4, **kw).engine
    decode = LLM(path, kv_role="decode", block_size=8, **kw).engine
    try:
        prompt, params, offer = _offer(prefill)
        with pytest.raises(ValueError, match=r"cannot hand its KV over to .*block_size: 4 on "
                                             r"prefill-\w+, 8 here"):
            decode.add_request("d", prompt, params,
                               handover_in=HandoverIn(offer, prefill.handover.endpoint()))
        assert not decode.has_unfinished_requests()
        assert "d" not in decode.scheduler.requests
    finally:
        prefill.shutdown()
        decode.shutdown()
