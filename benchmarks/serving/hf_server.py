"""A thin OpenAI-compatible streaming server over HF transformers, the benchmark's baseline.

One request at a time (an asyncio lock around `model.generate`): this is what a plain
transformers deployment does without a batching engine. bf16, greedy or sampled, with
`stream_options.include_usage`; `ignore_eos` maps to `min_new_tokens=max_tokens`.

    python benchmarks/serving/hf_server.py HF_DIR --port 8003 --threads 2
"""


import argparse
import asyncio
import json
import threading
import time
import uuid


def build_app(model_dir: str, served_name: str):
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    app = FastAPI()
    lock = asyncio.Lock()

    class QueueStreamer(BaseStreamer):
        """Sends each new text delta to an asyncio queue; the first put is the prompt."""

        def __init__(self, loop, queue):
            self.loop, self.queue, self.ids, self.text, self.prompt_seen = loop, queue, [], "", False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.ids.extend(value.reshape(-1).tolist())
            text = tokenizer.decode(self.ids, skip_special_tokens=True)
            delta, self.text = text[len(self.text):], text
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tok", delta))

        def end(self):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", len(self.ids)))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    async def generate(body: dict, chat: bool):
        if chat:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                return_dict=False, tokenize=True)
        else:
            ids = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        kw = {"max_new_tokens": max_tokens, "do_sample": temperature > 0,
              "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id}
        if temperature > 0:
            kw.update(temperature=temperature, top_p=float(body.get("top_p") or 1.0))
        if body.get("ignore_eos"):
            kw["min_new_tokens"] = max_tokens
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        streamer = QueueStreamer(loop, queue)
        input_ids = torch.tensor([ids])
        cancelled = threading.Event()

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return cancelled.is_set()

        def work():
            with torch.inference_mode():
                model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                               streamer=streamer, stopping_criteria=[Cancelled()], **kw)

        async with lock:
            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            try:
                while True:
                    kind, value = await queue.get()
                    if kind == "end":
                        yield ("end", (len(ids), value))
                        break
                    yield ("tok", value)
            finally:  # the client went away (or we finished): stop and wait for the thread
                cancelled.set()
                await asyncio.to_thread(thread.join)

    def chunk(rid, chat, text, finish=None, usage=None):
        obj = "chat.completion.chunk" if chat else "text_completion"
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        out = {"id": rid, "object": obj, "created": int(time.time()), "model": served_name,
               "choices": [] if usage else [choice]}
        if usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        rid = f"hf-{uuid.uuid4().hex[:12]}"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if not body.get("stream"):
            text, usage = "", None
            async for kind, value in generate(body, chat):
                if kind == "tok":
                    text += value
                else:
                    usage = {"prompt_tokens": value[0], "completion_tokens": value[1],
                             "total_tokens": sum(value)}
            msg = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return JSONResponse({"id": rid, "model": served_name, "usage": usage,
                                 "choices": [{"index": 0, "finish_reason": "length", **msg}]})

        async def events():
            async for kind, value in generate(body, chat):
                if kind == "tok":
                    if value:
                        yield chunk(rid, chat, value)
                else:
                    yield chunk(rid, chat, "", finish="length")
                    if include_usage:
                        yield chunk(rid, chat, "", usage={
                            "prompt_tokens": value[0], "completion_tokens": value[1],
                            "total_tokens": sum(value)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main() -> None:
    import torch
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8003)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--served-model-name", default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(build_app(args.model_dir, args.served_model_name), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
