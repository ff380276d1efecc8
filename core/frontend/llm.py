"""The offline API, in vLLM's shapes: `LLM(model).generate(...)` and `.chat(...)`."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.frontend.tokenizing import apply_chat_template
from tokenmill.platforms.plugins import KINDS
from tokenmill.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
Message = dict[str, Any]
LOGGING_ENV = "TOKENMILL_CONFIGURE_LOGGING"  # 0: LLM() leaves logging alone


def configure_default_logging() -> None:
    """INFO from tokenmill and its plugins (of every kind) on stderr (what loads, kernel builds, the
    defaults applied), as vLLM's LLM logs, unless the application configured logging
    (a handler on the root logger) or TOKENMILL_CONFIGURE_LOGGING=0."""
    if os.environ.get(LOGGING_ENV, "1").strip() == "0" or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    plugins = {ep.value.split(".")[0] for kind in KINDS
               for ep in entry_points(group=kind.entry_point_group)}
    for name in ("tokenmill", *sorted(plugins)):
        logger = logging.getLogger(name)
        if not logger.handlers:  # a second LLM() finds them configured
            logger.setLevel(logging.INFO)
            logger.addHandler(handler)


class LLM:
    """An engine for offline batches.

    `model` is an HF model directory or a .gguf file; None loads the embedded default,
    SmolLM2-135M-Instruct. Other keyword arguments are `EngineArgs` fields; `registry`
    (a `PlatformRegistry`) lets in-process plugins be chosen by name. Logs at INFO on
    stderr unless the application set up logging (`configure_default_logging`).
    """

    def __init__(
        self, model: str | None = None, dtype: str = "auto", registry=None, **engine_args: Any
    ) -> None:
        args = EngineArgs(model=model, dtype=dtype, **engine_args)
        configure_default_logging()
        if args.data_parallel_size > 1:
            from tokenmill.frontend.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(args, registry)
        else:
            self.engine = LLMEngine(args, registry)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def sleep(self, level: int = 1) -> None:
        """Sleep mode (vLLM's): free the device memory; level 1 keeps the weights in host
        memory and discards the KV cache, level 2 discards both. `generate` / `chat` raise
        EngineSleepingError until `wake_up()`. Needs a platform that declares sleep_mode."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Back from `sleep`: same weights, an empty KV cache, the same greedy outputs."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in the order of `prompts`.

        A prompt is a string, `{"prompt": str}` or `{"prompt_token_ids": list[int]}`.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_for(len(prompts), sampling_params)
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or several."""
        if not messages:
            raise ValueError("messages is empty: give a conversation or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params_list = self._params_for(len(conversations), sampling_params)
        template = chat_template or self.engine.args.chat_template or self.engine.loaded.chat_template
        encoded = []
        for conv in conversations:
            text = apply_chat_template(
                self.engine.tokenizer, conv, template, add_generation_prompt, tools
            )
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            encoded.append((text, ids))
        return self._run(encoded, params_list, use_tqdm)

    # ---- helpers -----------------------------------------------------------------------
    @staticmethod
    def _params_for(n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params holds {type(p).__name__}, not SamplingParams")
        return params

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise TypeError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
        raise TypeError(
            f"unsupported prompt {prompt!r:.80}: give a string, {{'prompt': str}} or "
            "{'prompt_token_ids': list[int]}"
        )

    def _run(self, encoded, params_list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(encoded), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        try:
            for (text, token_ids), params in zip(encoded, params_list):
                rid = engine.next_request_id()
                engine.add_request(rid, token_ids, params, prompt=text)
                ids.append(rid)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
        return [finished[rid] for rid in ids]
