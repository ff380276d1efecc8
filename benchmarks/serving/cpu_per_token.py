"""CPU seconds per output token of each process of `tokenmill serve` (API server, engine
core) and of the client, against the engine core alone in this process: the served cost
that a busy machine's contention does not blur.

    python benchmarks/serving/cpu_per_token.py [--num 64] [--input-len 256] [--output-len 64]

Served: one run of `--num` streamed completions at concurrency `--num`, CPU read from
/proc/PID/stat of the server and its children before and after, the client's from
`time.process_time`. Engine only: the same token ids through `LLMEngine.core_step()`,
`time.process_time`. Both runs see their prompts for the first time (cold prefix cache).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import engines
from served_vs_engine import _model_path, _words

from tokenmill.server.bench import workloads as wl
from tokenmill.server.bench.loadgen import Target, run_client, run_workload


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8766)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    import torch

    from tokenmill import SamplingParams
    from tokenmill.engine.config import EngineArgs
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.frontend.outputs import EngineCoreRequest

    torch.set_num_threads(args.threads)
    model = _model_path(args.model)
    engine = LLMEngine(EngineArgs(model=model, max_model_len=2048))
    words = _words(engine)
    spec = engines.EngineSpec(
        "tokenmill",
        [sys.executable, "-m", "tokenmill.server.cli", "serve", model, "--port", str(args.port),
         "--served-model-name", engines.SERVED, "--max-model-len", "2048", "--log-level", "warning"],
        env={"OMP_NUM_THREADS": str(args.threads)}, extra_body={"ignore_eos": True},
    )
    target = Target(f"http://127.0.0.1:{args.port}", engines.SERVED, spec.extra_body)
    log = Path(tempfile.gettempdir()) / "cpu_per_token.log"
    with engines.EngineProcess(spec, args.port, log) as server:
        api = server.proc.pid
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(api)], capture_output=True,
                                                   text=True).stdout.split()]
        run_client(run_workload(target, wl.uniform(words, 4, 64, 8, tag="warm"), 4, 120, 300))
        sessions = wl.uniform(words, args.num, args.input_len, args.output_len, tag="served")
        before = {p: _cpu_s(p) for p in [api, *children]}
        client0 = time.process_time()
        results, _ = run_client(run_workload(target, sessions, args.num, 600, 900))
        client = time.process_time() - client0
        used = {p: _cpu_s(p) - before[p] for p in before}
    num = sum(r.output_tokens for r in results)
    engine_proc = max((p for p in children), key=lambda p: used[p])

    prompts = [engine.tokenizer.encode(s.turns[0].prompt)
               for s in wl.uniform(words, args.num, args.input_len, args.output_len, tag="alone")]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    cpu0, alone = time.process_time(), 0
    for i, ids in enumerate(prompts):
        engine.add_core_request(EngineCoreRequest(f"alone-{i}", ids, params))
    while engine.has_unfinished_requests():
        alone += sum(len(d.new_token_ids) for d in engine.core_step())
    alone_ms = (time.process_time() - cpu0) / alone * 1000

    per = {k: v / num * 1000 for k, v in
           (("engine", used[engine_proc]), ("api", used[api]), ("client", client))}
    print(f"\n{args.num} x ({args.input_len} in, {args.output_len} out), {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| where | CPU per output token |\n|---|---|")
    print(f"| engine only: in-process `core_step()` | {alone_ms:.3f} ms |")
    print(f"| served: engine core process | {per['engine']:.3f} ms |")
    print(f"| served: API server process | {per['api']:.3f} ms |")
    print(f"| served: the client | {per['client']:.3f} ms |")
    total = sum(per.values())
    print(f"| served, all three | {total:.3f} ms: {total / alone_ms:.3f}x the engine alone |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
