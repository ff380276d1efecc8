"""One chat request through the openai SDK and one message through the anthropic SDK to a
running `tokenmill serve` (.ci/run). Usage: python sdk_check.py http://127.0.0.1:8000"""

from __future__ import annotations

import sys

import anthropic
import openai

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main(base_url: str) -> int:
    chat = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused").chat.completions.create(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi!"}])
    text = chat.choices[0].message.content
    print(f"openai SDK: {text!r}")
    message = anthropic.Anthropic(base_url=base_url, api_key="unused").messages.create(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi!"}])
    answer = "".join(block.text for block in message.content if block.type == "text")
    print(f"anthropic SDK: {answer!r}")
    if not text or not answer:
        print("an SDK got an empty answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
