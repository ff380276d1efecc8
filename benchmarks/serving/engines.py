"""Launchers for the engines under test: one server at a time, same model, same 2 threads.

Each engine is a command line plus environment; `EngineProcess` starts it in its own
process group, waits for /v1/models, and stops the whole group (SIGTERM, then SIGKILL).
Paths default to the layout `prepare_peers.sh` makes (override with PEERS_DIR).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# the peer engines and models live beside the repo, in peers/ (prepare_peers.sh)
PEERS = Path(os.environ.get("PEERS_DIR", Path(__file__).resolve().parents[3] / "peers"))
HF_DIR = PEERS / "models" / "smollm2-135m-bf16"
BF16_GGUF = PEERS / "models" / "smollm2-135m-bf16.gguf"
SERVED = "smollm2"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)  # fields that make outputs run to max_tokens
    startup_timeout_s: float = 600.0
    version_cmd: list[str] = field(default_factory=list)
    kv_block_size: int | None = None  # prefix-cache granularity in tokens; None: no reported reuse


def _tokenmill_block_size() -> int:
    from tokenmill.engine.config import EngineArgs

    return EngineArgs.model_fields["block_size"].default  # the launcher passes no --block-size


def _q41_gguf() -> str:
    from tokenmill.model.loader import default_model_path

    return str(default_model_path())


def with_kv_pool(specs: dict[str, EngineSpec], pool_bytes: int, offload_host: str,
                 offload_disk: str | None, offload_disk_bytes: str) -> dict[str, EngineSpec]:
    """The same engines with a device KV pool of `pool_bytes` (tokenmill and vLLM take
    the same --kv-cache-memory-bytes; vLLM's VLLM_CPU_KVCACHE_SPACE, whole GiB, would win
    over it, so it is dropped), plus "tokenmill-offload": tokenmill with the host tier
    (and the disk tier under `offload_disk`, if given) behind that pool, and
    "tokenmill-fp8kv": tokenmill with an FP8 KV cache in the same bytes (twice the tokens;
    docs/quantized-kv.md)."""
    out = dict(specs)
    pool = ["--kv-cache-memory-bytes", str(pool_bytes)]
    for name in ("tokenmill", "vllm"):
        spec = specs[name]
        env = {k: v for k, v in spec.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        out[name] = dataclasses.replace(spec, argv=[*spec.argv, *pool], env=env)
    tiers = ["--kv-offload-host-bytes", offload_host]
    if offload_disk:
        tiers += ["--kv-offload-disk-path", offload_disk, "--kv-offload-disk-bytes", offload_disk_bytes]
    out["tokenmill-offload"] = dataclasses.replace(
        out["tokenmill"], name="tokenmill-offload", argv=[*out["tokenmill"].argv, *tiers])
    out["tokenmill-fp8kv"] = dataclasses.replace(
        out["tokenmill"], name="tokenmill-fp8kv",
        argv=[*out["tokenmill"].argv, "--kv-cache-dtype", "fp8"])
    return out


def engine_specs(port: int, threads: int, max_model_len: int) -> dict[str, EngineSpec]:
    """Every engine the harness knows; `available()` says which are installed here."""
    thr = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    main_py = sys.executable
    vllm_py = str(PEERS / "vllm" / "bin" / "python")
    llama_py = str(PEERS / "llamacpp" / "bin" / "python")
    llama_args = ["--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
                  "--n_threads_batch", str(threads), "--n_ctx", str(max_model_len),
                  "--model_alias", SERVED, "--interrupt_requests", "False"]
    # llama-cpp-python's server has no ignore_eos; a -100 logit bias on <|im_end|> (2) and
    # <|endoftext|> (0) does the same for this model.
    llama_body = {"logit_bias": {"0": -100, "2": -100}}
    return {
        "tokenmill": EngineSpec(
            "tokenmill",
            [main_py, "-m", "tokenmill.server.cli", "serve", str(HF_DIR), "--port", str(port),
             "--served-model-name", SERVED, "--max-model-len", str(max_model_len),
             "--log-level", "warning"],
            env=thr, extra_body={"ignore_eos": True}, kv_block_size=_tokenmill_block_size(),
            version_cmd=[main_py, "-c", "import importlib.metadata as m; print(m.version('tokenmill'))"]),
        "vllm": EngineSpec(
            "vllm",
            [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR),
             "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED,
             "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
             "--enable-prompt-tokens-details"],
            env={**thr, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"},
            # vLLM's CPU platform picks 128-token blocks when --block-size is not given
            # (vllm/platforms/cpu.py); its reported cached tokens are multiples of 128
            extra_body={"ignore_eos": True}, startup_timeout_s=1200.0, kv_block_size=128,
            version_cmd=[vllm_py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]),
        "llamacpp-bf16": EngineSpec(
            "llamacpp-bf16", [llama_py, "-m", "llama_cpp.server", "--model", str(BF16_GGUF), *llama_args],
            env=thr, extra_body=llama_body,
            version_cmd=[llama_py, "-c", "import llama_cpp; print(llama_cpp.__version__)"]),
        "llamacpp-q4_1": EngineSpec(
            "llamacpp-q4_1", [llama_py, "-m", "llama_cpp.server", "--model", _q41_gguf(), *llama_args],
            env=thr, extra_body=llama_body,
            version_cmd=[llama_py, "-c", "import llama_cpp; print(llama_cpp.__version__)"]),
        "transformers": EngineSpec(
            "transformers",
            [main_py, str(HERE / "hf_server.py"), str(HF_DIR), "--port", str(port),
             "--threads", str(threads), "--served-model-name", SERVED],
            env=thr, extra_body={"ignore_eos": True},
            version_cmd=[main_py, "-c", "import transformers; print(transformers.__version__)"]),
    }


def available(spec: EngineSpec) -> tuple[bool, str]:
    exe = Path(spec.argv[0])
    if not exe.exists():
        return False, f"{exe} missing: run benchmarks/serving/prepare_peers.sh"
    for arg in spec.argv:
        if arg.endswith((".gguf", "-bf16")) and not Path(arg).exists():
            return False, f"{arg} missing: run benchmarks/serving/prepare_peers.sh"
    return True, ""


def version(spec: EngineSpec) -> str:
    try:
        return subprocess.run(spec.version_cmd, capture_output=True, text=True, timeout=120,
                              check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        return f"unknown ({type(e).__name__})"


class EngineProcess:
    """A running server; use as a context manager. Logs go to `log_path`."""

    def __init__(self, spec: EngineSpec, port: int, log_path: Path):
        self.spec, self.port, self.log_path = spec, port, log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.spec.argv, env={**os.environ, **self.spec.env},
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while time.perf_counter() - t0 < self.spec.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} while "
                                   f"starting; see {self.log_path}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"{self.spec.name} not ready after {self.spec.startup_timeout_s} s; "
                           f"see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
