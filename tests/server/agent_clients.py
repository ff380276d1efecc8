"""What the agent-client tests share: a tiny long-context model, `tokenmill serve` in a
network namespace of its own (loopback only), and commands run inside that namespace.

Agent clients send long prompts (Claude Code's first request is about 50 KB: system
prompt, a dozen tool schemas), so the model is a tiny random llama with a 64k context and
a BPE vocabulary trained on this repository's docs (English and JSON tokenize into about
a quarter as many tokens as bytes). The check is the protocol, not the answers.

The namespace holds only a loopback interface: a client run in it can reach the server
and nothing else, so no test here can send traffic off the machine.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tokenmill_conformance.tiny_models import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
AGENT_MODEL = "tiny-agent"
CONTEXT = 65536
LO_UP = Path(__file__).with_name("netns_lo_up.py")
# uvicorn's access log: `127.0.0.1:PORT - "POST /v1/messages?beta=true HTTP/1.1" 200`
ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3})')


def make_agent_model(path: Path) -> Path:
    """A tiny random llama (2 layers, hidden 64) with a 64k context and a 4096-token BPE
    vocabulary, saved as an HF directory."""
    text = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _end_answers_soon(model, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _end_answers_soon(model: LlamaForCausalLM, eos: int, p_eos: float = 0.15) -> None:
    """Make each sampled token EOS with probability about `p_eos` (answers of a few tokens).

    Clients treat an answer cut by max_tokens as an error (Claude Code retries, then fails),
    so the model must end on its own. Every embedding gets a large constant in dimension 0,
    which then dominates the normed hidden state (about sqrt(hidden) there, near 0
    elsewhere); the LM head's EOS row reads that dimension, the other rows see noise, so
    the EOS logit sits `log(p / (1 - p) * (vocab - 1))` above a near-uniform rest."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    target = math.log(p_eos / (1 - p_eos) * (vocab - 1))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[eos].zero_()
        model.lm_head.weight[eos, 0] = target / math.sqrt(hidden)


@dataclass
class IsolatedServer:
    """`tokenmill serve` in its own network namespace; `log` is its combined output."""

    proc: subprocess.Popen
    url: str
    log: Path

    @property
    def netns(self) -> str:
        return f"/proc/{self.proc.pid}/ns/net"

    def run(self, argv: list[str], env: dict[str, str], timeout_s: float, cwd: Path
            ) -> subprocess.CompletedProcess:
        """Run `argv` inside the server's network namespace."""
        return subprocess.run(["nsenter", f"--net={self.netns}", "--", *argv], env=env,
                              cwd=cwd, capture_output=True, text=True, timeout=timeout_s)

    def access_log(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request the server answered so far."""
        return [(m["method"], m["path"], int(m["status"]))
                for m in ACCESS.finditer(self.log.read_text(errors="replace"))]


@contextmanager
def isolated_serve(model: Path, log: Path, port: int = 8000, *args: str
                   ) -> Iterator[IsolatedServer]:
    """`tokenmill serve MODEL` with no tool flags, alone with a loopback interface."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        raise RuntimeError("these tests need util-linux's unshare and nsenter")
    tokenmill = Path(sys.executable).with_name("tokenmill")
    argv = ["unshare", "--net", "--", sys.executable, str(LO_UP), str(tokenmill), "serve",
            str(model), "--port", str(port), "--served-model-name", AGENT_MODEL,
            "--dtype", "float32", "--max-model-len", str(CONTEXT),
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "8192",
            "--long-prefill-token-threshold", "0", "--log-level", "info", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = IsolatedServer(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 300
        while "Application startup complete" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tokenmill serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()  # serve stops its engine process itself
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
