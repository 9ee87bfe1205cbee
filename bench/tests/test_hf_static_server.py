"""The static-batching baseline: its streamer, its detokenizer, and (slow) the real server."""

import asyncio
import json

import httpx
import pytest

from bench.baselines.hf_static_server import BatchStreamer, Pending, prompt_ids_of
from bench.baselines.incremental_text import IncrementalText


class FakeTokenizer:
    """Decodes id i as chr(i); id 0 is half a character (U+FFFD) until another follows."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(i) for i in ids if i)
        return text + "\ufffd" if ids and ids[-1] == 0 else text


async def drain(pending: Pending) -> list:
    await asyncio.sleep(0)
    items = []
    while not pending.out.empty():
        items.append(pending.out.get_nowait())
    return items


async def test_streamer_stops_each_row_at_its_own_max_tokens():
    import torch

    loop = asyncio.get_running_loop()
    short, long = Pending([1], 1, True, loop), Pending([1, 2], 3, True, loop)
    streamer = BatchStreamer([short, long], eos_token_id=2)
    streamer.put(torch.tensor([[0, 1], [1, 2]]))  # the prompt: not streamed
    for step in range(3):
        streamer.put(torch.tensor([10 + step, 20 + step]))
    streamer.end()
    assert await drain(short) == [(10, True)]
    assert await drain(long) == [(20, False), (21, False), (22, True)]


async def test_streamer_ends_a_row_at_eos_unless_ignore_eos():
    import torch

    loop = asyncio.get_running_loop()
    stops, ignores = Pending([1], 5, False, loop), Pending([1], 2, True, loop)
    streamer = BatchStreamer([stops, ignores], eos_token_id=2)
    streamer.put(torch.tensor([[1], [1]]))
    streamer.put(torch.tensor([2, 2]))
    streamer.put(torch.tensor([7, 7]))
    streamer.end()
    assert await drain(stops) == [(2, True)]
    assert await drain(ignores) == [(2, False), (7, True)]


def test_incremental_text_holds_back_half_characters():
    text = IncrementalText(FakeTokenizer())
    assert text.add(ord("a")) == "a"
    assert text.add(0) == ""
    assert text.add(ord("b")) == "b"
    assert text.full == "ab" and text.num_tokens == 3


def test_prompt_forms():
    class Tok:
        def __call__(self, text, add_special_tokens):
            return type("E", (), {"input_ids": [len(text)]})()

    assert prompt_ids_of("abc", Tok()) == [3]
    assert prompt_ids_of([5, 6], Tok()) == [5, 6]
    with pytest.raises(ValueError):
        prompt_ids_of(["a", "b"], Tok())


@pytest.mark.slow
async def test_real_server_batches_and_streams():
    from bench.baselines.hf_model import load_hf_model
    from bench.baselines.hf_static_server import StaticBatcher, create_app

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
    from types import SimpleNamespace

    from bench.baselines.hf_static_server import StaticBatcher

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    seen = {}

    def load():
        seen["thread"] = threading.current_thread().name
        return "model"

    batcher = StaticBatcher(load, tokenizer, max_batch_size=2)
    batcher.wait_loaded()
    assert seen["thread"] == "static-batcher" and batcher.model == "model"

    def broken():
        raise OSError("no weights here")

    with pytest.raises(OSError, match="no weights"):
        StaticBatcher(broken, tokenizer, max_batch_size=2).wait_loaded()
