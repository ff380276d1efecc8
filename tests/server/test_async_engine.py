"""AsyncLLM without HTTP: outputs equal the offline engine's, leaving a generator aborts and
frees KV, bad prompts raise, shutdown fails in-flight requests instead of hanging."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_engine

from tokenmill import LLM, SamplingParams
from tokenmill.frontend.async_engine import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine, ids, params, rid):
    outs = [out async for out in engine.generate(ids, params, rid)]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs[-1]


def test_generate_matches_offline(engine, tiny_model):
    offline = LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=256)
    prompts = ["The quick brown fox", "def main():", "Paris is"]
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY, use_tqdm=False)]

    async def main():
        ids = [await engine.encode(p) for p in prompts]
        return await asyncio.gather(*(collect(engine, i, GREEDY, f"m{k}") for k, i in enumerate(ids)))

    assert [o.outputs[0].token_ids for o in asyncio.run(main())] == expected


def test_leaving_early_aborts_and_frees_kv(engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = engine.generate([1, 2, 3, 4, 5], params, "early")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        for _ in range(200):
            if engine.stats.num_running == 0 and engine.stats.kv_usage == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_bad_prompt_raises_value_error(engine):
    async def main():
        with pytest.raises(ValueError, match="over the context"):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=10_000), "bad")
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], GREEDY, "empty")
        return await collect(engine, [1, 2, 3], GREEDY, "after")  # still serving

    assert len(asyncio.run(main()).outputs[0].token_ids) == 10


def test_shutdown_fails_in_flight(tiny_model):
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    engine.start()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = engine.generate([1, 2, 3], params, "x")
        await anext(gen)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate([1, 2, 3], params, "y"))

    asyncio.run(asyncio.wait_for(main(), 20))
    assert engine.is_dead
