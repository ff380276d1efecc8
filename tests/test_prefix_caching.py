"""Prefix caching under a tight KV pool, through `LLM`: outputs with caching on must equal
outputs with caching off, whatever the pool evicts while it admits requests."""

from tokenmill import LLM, SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_scenario(path, caching: bool) -> list[list[int]]:
    """Two 12-token requests fill a 6-block pool of 4-token blocks and finish, leaving
    their blocks cached in the free queue ([a2, a1, a0, b2, b1, b0], least recent first).
    Then a cold 3-token request and a 16-token request reusing a's 12 tokens arrive in the
    same step. The cold one has the shorter remaining prefill, so it is allocated first,
    from the head of the free queue: block a2, which the other request counted as a cache
    hit when the step's candidates were sorted."""
    llm = LLM(
        str(path), dtype="float32", block_size=4, num_kv_blocks=6,
        enable_prefix_caching=caching,
    )
    a = list(range(10, 22))
    b = list(range(40, 52))
    llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], greedy(1), use_tqdm=False)
    cold = [70, 71, 72]
    hitting = a + [80, 81, 82, 83]
    outs = llm.generate(
        [{"prompt_token_ids": cold}, {"prompt_token_ids": hitting}],
        [greedy(1), greedy(4)],
        use_tqdm=False,
    )
    if caching:
        # the scenario really hits a's prefix (a2, taken by the cold request, is not a hit)
        assert outs[1].num_cached_tokens == 8
    assert llm.engine.kv.usage == 0.0
    return [o.outputs[0].token_ids for o in outs]


def test_cold_request_cannot_take_a_block_another_request_hit(tiny_dirs):
    assert run_scenario(tiny_dirs["llama"], True) == run_scenario(tiny_dirs["llama"], False)
