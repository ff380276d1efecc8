"""1P1D through real processes on loopback: `tokenmill serve --kv-role prefill`, `--kv-role
decode` and `tokenmill router`, driven by the real OpenAI and Anthropic SDKs. Greedy output
equals a colocated engine's for a dense model (llama) and a hybrid one (qwen3_next: Gated
DeltaNet state + full attention), single and batched, streamed and not; the second time a
prompt comes the decode instance pulls only the blocks its prefix cache lacks; the bytes
moved are exactly the pulled blocks' pages (a recurrent group's state included)."""

from __future__ import annotations

import anthropic
import openai
import pytest
from pd_cluster import BLOCK_SIZE, cluster, metric

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.long,  # engine pairs or server processes for prefill and decode: minutes
    pytest.mark.xdist_group("pd_servers"),  # module-scoped server clusters: one xdist worker
]

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 250 + 5 for j in range(n)] for i, n in enumerate([13, 22, 9])]


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def pd(request, tmp_path_factory):
    """(arch, router URL, prefill URLs, decode URLs, colocated texts, page bytes)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"pd-{arch}")
    model = make_tiny_model(root / "model", arch)
    colocated = LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    texts = [o.outputs[0].text for o in colocated.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    # the pages of one state of every recurrent group (what a handover moves for them)
    state_pages = sum(g.state_pages or 0 for g in colocated.engine.kv.groups)
    colocated.engine.shutdown()
    with cluster(model, root) as (front, prefill, decode):
        yield arch, front.url, [p.url for p in prefill], [d.url for d in decode], texts, state_pages


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_single_batch_and_stream_identical_to_colocated(pd):
    _, url, prefill, decode, texts, _ = pd
    client = _client(url)
    one = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert one.choices[0].text == texts[0]
    batch = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == texts
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_NEW,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts[1]
    # every prompt went through a handover (none computed on the decode instance)
    assert metric(prefill[0], "tokenmill:kv_handover_offered_total") == 5
    assert metric(decode[0], "tokenmill:kv_handover_received_total") == 5
    assert metric(decode[0], "tokenmill:kv_handover_failed_total") == 0


def test_decode_side_prefix_hit_pulls_only_missing_blocks(pd):
    arch, url, prefill, decode, texts, state_pages = pd
    client = _client(url)
    prompt = list(range(40, 56))  # 16 tokens no earlier prompt shares: 4 full blocks
    before = {k: metric(decode[0], f"tokenmill:kv_handover_{k}_total")
              for k in ("blocks_pulled", "blocks_skipped", "bytes")}
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    mid = {k: metric(decode[0], f"tokenmill:kv_handover_{k}_total") for k in before}
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
    after = {k: metric(decode[0], f"tokenmill:kv_handover_{k}_total") for k in before}
    assert again.choices[0].text == first.choices[0].text
    groups_attention = 1  # both tiny models have one attention group
    full = len(prompt) // BLOCK_SIZE
    # first time: every block of every attention group, and the recurrent state's pages
    assert mid["blocks_pulled"] - before["blocks_pulled"] == full * groups_attention + state_pages
    assert mid["blocks_skipped"] == before["blocks_skipped"]
    # second time: the decode instance's prefix cache holds every full block; only the
    # recurrent state (exactly at the boundary) moves
    assert after["blocks_pulled"] - mid["blocks_pulled"] == state_pages
    assert after["blocks_skipped"] - mid["blocks_skipped"] == full * groups_attention
    page = (mid["bytes"] - before["bytes"]) / (full * groups_attention + state_pages)
    assert after["bytes"] - mid["bytes"] == page * state_pages
    # counted at the transport: exactly those pages' bytes, nothing else moved
    assert metric(decode[0], "tokenmill:kv_handover_transport_bytes_total") == after["bytes"]
    assert metric(prefill[0], "tokenmill:kv_handover_leases_held") == 0


def test_chat_and_anthropic_routes_through_the_router(pd):
    _, url, _, decode, _, _ = pd
    received = metric(decode[0], "tokenmill:kv_handover_received_total")
    chat = _client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "The quick brown fox"}],
        max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        with client.messages.stream(
            model="tiny", max_tokens=4,
            messages=[{"role": "user", "content": "Paris is the capital"}],
        ) as stream:
            text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens == 4 or final.stop_reason == "end_turn"
    assert isinstance(text, str)
    assert metric(decode[0], "tokenmill:kv_handover_received_total") == received + 2
