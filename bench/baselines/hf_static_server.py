"""Baseline (a): transformers `generate` with static batching behind /v1/completions.

The traditional engine: take up to `max_batch_size` requests that are waiting, left-pad
them into one batch, run `generate` until the batch's longest output is done, and only
then take new requests. Tokens stream per step (a streamer receives each step's tokens
as `generate` produces them), so a request's first token arrives when its batch's first
step is done: TTFT includes the time spent waiting for the previous batch.

    .venv/bin/python -m bench.baselines.hf_static_server --port 8100 --max-batch-size 64

Prints `CONVEYOR_LISTENING port=N` once bound (port 0 picks a free one), like the services.
Each option's default can also come from the environment (BENCH_HF_PORT, BENCH_HF_MODEL,
BENCH_HF_MAX_BATCH_SIZE, BENCH_HF_THREADS), so `ServiceProcess` can start it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.baselines.hf_model import load_hf_model
from bench.baselines.incremental_text import IncrementalText
from conveyor.common.models import load_tokenizer, resolve_model


@dataclass(slots=True)
class Pending:
    """A request waiting for, or running in, a batch.

    Its stream goes to `out` on `loop` as (token id or None, is_last) pairs, or an exception.
    """

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_sent: int = 0

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class BatchStreamer:
    """A transformers streamer that hands each step's tokens to the batch's requests.

    `generate` calls `put` once with the prompt ids, then once per step with one token
    per row; a row stops receiving after its own max_tokens or its EOS.
    """

    def __init__(self, batch: list[Pending], eos_token_id: int):
        self.batch = batch
        self.eos_token_id = eos_token_id
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for row, token in zip(self.batch, value.reshape(-1).tolist(), strict=True):
            if row.num_sent < row.max_tokens:
                row.num_sent += 1
                is_last = row.num_sent == row.max_tokens or (
                    token == self.eos_token_id and not row.ignore_eos)
                if is_last:
                    row.num_sent = row.max_tokens
                row.send((token, is_last))

    def end(self) -> None:
        for row in self.batch:
            if row.num_sent < row.max_tokens:
                row.send((None, True))


class StaticBatcher:
    """One thread that runs batches back to back; requests queue in between.

    `model` is the model, or a function that loads it: then the batcher's thread loads it
    and `wait_loaded` returns once it has (raising what the load raised), so all of the
    model's torch work runs on one thread, as in Conveyor's engine (two threads opening
    OpenMP regions stop libgomp's workers spinning: docs/performance.md, "One thread for the
    engine's torch work")."""

    def __init__(self, model, tokenizer, max_batch_size: int):
        self._load = None if isinstance(model, torch.nn.Module) else model
        self.model = None if self._load else model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.waiting: queue.Queue[Pending] = queue.Queue()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        threading.Thread(target=self._loop, daemon=True, name="static-batcher").start()

    def wait_loaded(self) -> None:
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    def submit(self, request: Pending) -> None:
        self.waiting.put(request)

    def _take_batch(self) -> list[Pending]:
        batch = [self.waiting.get()]
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self.waiting.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        try:
            if self._load is not None:
                self.model = self._load()
        except BaseException as exc:  # re-raised by wait_loaded
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        while True:
            batch = self._take_batch()
            try:
                self._run(batch)
            except Exception as exc:  # a failed batch must not stop the server
                for row in batch:
                    row.send(exc)

    def _run(self, batch: list[Pending]) -> None:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids
                            for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in batch])
        num_new = max(r.max_tokens for r in batch)
        ignore_eos = any(r.ignore_eos for r in batch)
        eos = self.tokenizer.eos_token_id
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=num_new,
                min_new_tokens=num_new if ignore_eos else 0, do_sample=False,
                pad_token_id=self.pad_id, eos_token_id=eos,
                streamer=BatchStreamer(batch, eos))


def prompt_ids_of(prompt, tokenizer) -> list[int]:
    """Token ids of a /v1/completions prompt: one string or one list of token ids."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False).input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise ValueError("prompt must be a string or a list of token ids")


def create_app(batcher: StaticBatcher, model_name: str) -> FastAPI:
    app = FastAPI()
    tokenizer = batcher.tokenizer

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await http_request.json()
        try:
            ids = prompt_ids_of(body.get("prompt"), tokenizer)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}},
                                status_code=400)
        pending = Pending(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")),
                          asyncio.get_running_loop())
        batcher.submit(pending)
        reply = Reply(tokenizer, model_name, len(ids), pending,
                      bool((body.get("stream_options") or {}).get("include_usage")))
        if body.get("stream"):
            return StreamingResponse(reply.sse(), media_type="text/event-stream")
        return JSONResponse(await reply.whole())

    return app


class Reply:
    """The OpenAI-shaped answer to one request, streamed or whole."""

    def __init__(self, tokenizer, model_name: str, prompt_len: int, pending: Pending,
                 include_usage: bool):
        self.text = IncrementalText(tokenizer)
        self.model_name = model_name
        self.prompt_len = prompt_len
        self.pending = pending
        self.include_usage = include_usage
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def tokens(self):
        """(token id or None, is_last) pairs until the last one."""
        while True:
            item = await self.pending.out.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item[1]:
                return

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        data = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices}
        if usage is not None:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

    def usage(self) -> dict:
        n = self.text.num_tokens
        return {"prompt_tokens": self.prompt_len, "completion_tokens": n,
                "total_tokens": self.prompt_len + n}

    def finish_reason(self) -> str:
        return "length" if self.text.num_tokens >= self.pending.max_tokens else "stop"

    async def sse(self):
        """One chunk per token; the last token's chunk carries the finish reason."""
        async for token, is_last in self.tokens():
            text = self.text.add(token) if token is not None else ""
            if is_last:
                text += self.text.flush()
            reason = self.finish_reason() if is_last else None
            yield self.chunk([{"index": 0, "text": text, "logprobs": None,
                               "finish_reason": reason}])
        if self.include_usage:
            yield self.chunk([], self.usage())
        yield "data: [DONE]\n\n"

    async def whole(self) -> dict:
        async for token, _ in self.tokens():
            if token is not None:
                self.text.add(token)
        self.text.flush()
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "usage": self.usage(),
                "choices": [{"index": 0, "text": self.text.full, "logprobs": None,
                             "finish_reason": self.finish_reason()}]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--model", default=env("BENCH_HF_MODEL", "smollm2-135m-instruct"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(env("BENCH_HF_PORT", "8100")))
    p.add_argument("--max-batch-size", type=int,
                   default=int(env("BENCH_HF_MAX_BATCH_SIZE", "64")))
    p.add_argument("--threads", type=int, default=int(env("BENCH_HF_THREADS", "0")),
                   help="torch threads (0 = torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model(args.model))
    batcher = StaticBatcher(lambda: load_hf_model(args.model)[0], tokenizer, args.max_batch_size)
    batcher.wait_loaded()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    config = uvicorn.Config(create_app(batcher, args.model), log_level="warning")
    print(f"hf static-batching baseline: torch threads {torch.get_num_threads()}, "
          f"max batch {args.max_batch_size}", flush=True)
    print(f"CONVEYOR_LISTENING port={sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
