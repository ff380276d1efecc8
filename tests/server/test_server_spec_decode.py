"""Speculative decoding served: a real server with `speculative_config`, the real
`openai` client, greedy replies equal to a server without it, the counters on /metrics,
`tokenmill bench serve` reporting the run's acceptance, and a bad
`--speculative-config` refused before anything loads."""

from __future__ import annotations

import openai
from conftest import TINY_NAME, running_server, scrape, tiny_engine, wait_idle

from tokenmill.server.app import build_app
from tokenmill.server.bench import serve as bench_serve
from tokenmill.server.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=32,
                                      temperature=0)
    return reply.choices[0].text


def test_served_speculation_matches_and_counts(tiny_model, base_url, tiny_server, capsys):
    want = _complete(base_url)
    engine = tiny_engine(tiny_model, speculative_config={
        "method": "suffix", "num_speculative_tokens": 4, "adaptive": False})
    with running_server(build_app(engine, [TINY_NAME])) as url:
        assert _complete(url) == want
        wait_idle(engine)
        metrics = scrape(url)
        drafts = metrics[("tokenmill:spec_decode_num_draft_tokens_total", (("method", "suffix"),))]
        accepted = metrics[("tokenmill:spec_decode_num_accepted_tokens_total",
                            (("method", "suffix"),))]
        assert drafts > 0 and 0 <= accepted <= drafts
        assert metrics[("tokenmill:spec_decode_mean_acceptance_length", (("method", "suffix"),))] >= 1
        # (the editing workload's prompts are longer than the tiny model's context)
        code = bench_serve.main(["--base-url", url, "--num-prompts", "2", "--input-len", "8",
                                 "--output-len", "16"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "spec_draft_tokens" in out and "spec_mean_acceptance_length" in out
    engine.shutdown()


def test_bad_speculative_config_exits_2(capsys):
    assert main(["serve", "--speculative-config", "{suffix}", "--port", "1"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["serve", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}',
                 "--port", "1"]) == 2
    assert "medusa" in capsys.readouterr().err
