"""The static-batching baseline: its streamer, its detokenizer, and (slow) the real server."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from bench.baselines.hf_static_server import (
    BatchStreamer,
    Pending,
    StaticBatcher,
    create_app,
    prompt_ids_of,
)
from bench.baselines.incremental_text import IncrementalText


def decode(ids, skip_special_tokens=True):
    """Id i is chr(i); id 0 is half a character (U+FFFD) until another follows."""
    text = "".join(chr(i) for i in ids if i)
    return text + "\ufffd" if ids and ids[-1] == 0 else text


async def drain(pending: Pending) -> list:
    await asyncio.sleep(0)
    return [pending.out.get_nowait() for _ in range(pending.out.qsize())]


async def test_streamer_ends_each_row_at_its_max_tokens_its_eos_or_the_batch_end():
    import torch

    loop = asyncio.get_running_loop()
    # EOS is 2: `short` stops at its max_tokens, `stops` at EOS, `ignores` runs past EOS to its
    # max_tokens, `cut` is still short of its own when the batch ends
    short, stops, ignores, cut = (Pending([1], n, ignore, loop)
                                  for n, ignore in ((1, True), (5, False), (3, True), (9, True)))
    streamer = BatchStreamer([short, stops, ignores, cut], eos_token_id=2)
    streamer.put(torch.tensor([[0, 2]] * 4))  # the prompt, EOS in it too: not streamed
    for step in ([10, 2, 2, 20], [11, 7, 7, 21], [12, 8, 8, 22]):
        streamer.put(torch.tensor(step))
    streamer.end()
    assert await drain(short) == [(10, True)]
    assert await drain(stops) == [(2, True)]
    assert await drain(ignores) == [(2, False), (7, False), (8, True)]
    assert await drain(cut) == [(20, False), (21, False), (22, False), (None, True)]


def test_incremental_text_holds_back_half_characters():
    text = IncrementalText(SimpleNamespace(decode=decode))
    assert text.add(ord("a")) == "a"
    assert text.add(0) == ""
    assert text.add(ord("b")) == "b"
    assert text.full == "ab" and text.num_tokens == 3


def test_prompt_forms():
    def tokenizer(text, add_special_tokens):
        return SimpleNamespace(input_ids=[len(text)])

    assert prompt_ids_of("abc", tokenizer) == [3]
    assert prompt_ids_of([5, 6], tokenizer) == [5, 6]
    with pytest.raises(ValueError):
        prompt_ids_of(["a", "b"], tokenizer)


@pytest.mark.slow
async def test_real_server_batches_and_streams():
    from bench.baselines.hf_model import load_hf_model

    model, tokenizer = load_hf_model()
    app = create_app(StaticBatcher(model, tokenizer, max_batch_size=4), "m")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async def stream(prompt, max_tokens):
            body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data")]
            return [json.loads(line[6:]) for line in lines[:-1]], lines[-1]

        (a, done_a), (b, _) = await asyncio.gather(stream("The sky is", 3),
                                                   stream([504, 3575, 282], 5))
        whole = (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                            "ignore_eos": True})).json()
    assert done_a == "data: [DONE]"
    assert [c["choices"][0]["finish_reason"] for c in a[:-1]] == [None, None, "length"]
    assert a[-1]["usage"]["completion_tokens"] == 3 and b[-1]["usage"]["completion_tokens"] == 5
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_a_loader_runs_on_the_batcher_thread_and_its_error_is_raised():
    """All of the model's torch work on one thread: the batcher's thread loads it."""
    import threading

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    batcher = StaticBatcher(lambda: threading.current_thread().name, tokenizer, max_batch_size=2)
    batcher.wait_loaded()
    assert batcher.model == "static-batcher"  # what the loader returned: its thread's name

    def broken():
        raise OSError("no weights here")

    with pytest.raises(OSError, match="no weights"):
        StaticBatcher(broken, tokenizer, max_batch_size=2).wait_loaded()
