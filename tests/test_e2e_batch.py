"""The Batch API end to end: real tokenizer, engine, detok and gateway processes (API keys
on), the real Redis, and real Celery worker processes (`python -m conveyor.batch`).

- The official `openai` client uploads 200 lines, creates a batch, polls it to completed
  and downloads the output: 200 lines in input order, greedy outputs equal to the same
  requests sent interactively, usage equal to the lines' sum.
- The worker SIGKILLed twice mid-batch and restarted (short visibility timeout): every
  line exactly once in the output and in the batch's usage.
- SIGTERM mid-batch: the worker finishes its lines in flight, hands the rest back and
  exits at once; another worker completes the batch, every line once.
- `python -m conveyor.batch run` submits, follows and downloads; `status` reads a batch.
- On an engine with 2 seats held by batch lines and more queued, an interactive request
  goes first: it is done before any queued batch line ran.
- Cancel mid-batch: cancelling -> cancelled, finished lines kept, the KV pool whole.
- Bad uploads, bad batch requests and bad lines get their documented errors; a batch
  whose every line fails is completed with an empty output file.
- Another tenant can neither see nor cancel a batch; a free-tier tenant's batch is not
  held back by its interactive limits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
from redis.asyncio import Redis

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers
from devkit.service_process import ServiceProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOKEN = f"e2e-batch-{uuid.uuid4().hex}"
VISIBILITY_TIMEOUT_S = 6.0
UPLOAD_LIMIT = 6 * 1024 * 1024
"""Above the gateway's 4 MiB JSON body limit, so the upload's own limit is what counts."""


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-files")


@pytest.fixture(scope="module")
def gateway(module_launch, files_dir) -> ServiceProcess:
    return module_launch.gateway(
        "gateway-batch", CONVEYOR_GATEWAY_AUTH_ENABLED="true",
        CONVEYOR_GATEWAY_BATCH_TOKEN=TOKEN, CONVEYOR_GATEWAY_FILES_DIR=str(files_dir),
        CONVEYOR_GATEWAY_MAX_UPLOAD_BYTES=str(UPLOAD_LIMIT))


@pytest.fixture(scope="module")
def keys(stack, gateway) -> dict[str, str]:
    """API keys of three tenants: a (premium), b (standard), free (free tier)."""
    async def create() -> dict[str, str]:
        redis = Redis.from_url(stack.redis_url, decode_responses=True)
        store = ApiKeyStore(redis, build_tiers({}), prefix=stack.redis_prefix)
        suffix = uuid.uuid4().hex[:8]
        made = {name: (await store.create(f"batch-{name}-{suffix}", tier)).key
                for name, tier in (("a", "premium"), ("b", "standard"), ("free", "free"))}
        await redis.aclose()
        return made

    return asyncio.run(create())


@pytest.fixture
def worker(stack, gateway, files_dir):
    """`worker()` starts a batch worker process (stopped at the test's end) sending its
    lines to the module's gateway, or to `worker(other_gateway)`."""
    started: list[ServiceProcess] = []

    def start(to_gateway: ServiceProcess = gateway) -> ServiceProcess:
        name = f"batch-worker-{len(started)}"
        process = stack.process(
            "batch", name, GATEWAY_URL=f"http://127.0.0.1:{to_gateway.port}",
            GATEWAY_TOKEN=TOKEN, FILES_DIR=str(files_dir),
            VISIBILITY_TIMEOUT_S=str(VISIBILITY_TIMEOUT_S), CHUNK_SIZE="16",
            POLL_INTERVAL_S="0.2", MAX_BACKOFF_S="2")
        started.append(process.start(timeout_s=60))
        return process

    yield start
    for process in started:
        process.stop()


def client_of(gateway: ServiceProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key,
                         max_retries=0, timeout=60)


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def submit(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                 completion_window="24h", metadata={"suite": "e2e"})


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout_s: float = 300):
    """Poll the batch until `done(batch)` holds; the batch then."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert batch.status not in {"failed", "expired", "cancelled"} or done(batch), batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)


def finished(batch) -> bool:
    return batch.status in {"completed", "failed", "expired", "cancelled"}


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def numbered_lines(n: int, max_tokens: int = 4) -> list[dict]:
    return [chat_line(f"req-{i}", f"Say the number {i}.", max_tokens) for i in range(n)]


def usage_of(gateway: ServiceProcess, key: str, batch_id: str) -> dict:
    response = httpx.get(f"http://127.0.0.1:{gateway.port}/v1/batches/{batch_id}",
                         headers={"Authorization": f"Bearer {key}"})
    return response.json()["usage"]


def assert_each_line_once(client, gateway, key, batch, lines: list[dict]) -> list[dict]:
    """The output holds every input line once, in input order, and the batch's usage
    is the sum of the lines' usage."""
    output = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in output] == [line["custom_id"] for line in lines]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert len({o["id"] for o in output}) == len(output)
    usage = usage_of(gateway, key, batch.id)
    assert usage["input_tokens"] == sum(o["response"]["body"]["usage"]["prompt_tokens"]
                                        for o in output)
    assert usage["output_tokens"] == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                         for o in output)
    assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0
    return output


def test_200_lines_in_order_equal_to_interactive(gateway, keys, worker):
    worker()
    client = client_of(gateway, keys["a"])
    lines = numbered_lines(200)
    batch = submit(client, lines)
    assert batch.status == "validating" and batch.request_counts.total == 0
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "completed", batch
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.metadata == {"suite": "e2e"} and batch.error_file_id is None
    output = assert_each_line_once(client, gateway, keys["a"], batch, lines)

    async def interactive() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1",
                                          api_key=keys["a"], max_retries=0, timeout=120)
        limit = asyncio.Semaphore(8)

        async def one(line: dict) -> str:
            async with limit:
                reply = await async_client.chat.completions.create(**line["body"])
                return reply.choices[0].message.content

        texts = await asyncio.gather(*(one(line) for line in lines))
        await async_client.close()
        return texts

    batch_texts = [o["response"]["body"]["choices"][0]["message"]["content"] for o in output]
    assert batch_texts == asyncio.run(interactive())


async def test_worker_killed_twice_every_line_once(gateway, keys, worker, idle_engine):
    client = client_of(gateway, keys["a"])
    lines = numbered_lines(200)
    first = worker()
    batch = submit(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 30)
    first.kill()
    assert client.batches.retrieve(batch.id).request_counts.completed < 100
    second = worker()
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 100)
    second.kill()
    assert client.batches.retrieve(batch.id).request_counts.completed < 200
    worker()
    batch = wait_for(client, batch.id, finished, timeout_s=300)
    assert batch.status == "completed", batch
    assert_each_line_once(client, gateway, keys["a"], batch, lines)
    stats = await idle_engine(timeout_s=10)  # the killed workers' lines were aborted
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0


def test_sigterm_hands_the_rest_back_at_once(gateway, keys, worker):
    client = client_of(gateway, keys["a"])
    lines = numbered_lines(100)
    first = worker()
    batch = submit(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 20)
    started = time.monotonic()
    assert first.stop(timeout_s=30) == 0
    assert time.monotonic() - started < 15
    assert client.batches.retrieve(batch.id).request_counts.completed < 100
    worker()
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "completed"
    assert_each_line_once(client, gateway, keys["a"], batch, lines)


def test_responses_lines_run_and_count_their_usage(gateway, keys, worker):
    worker()
    client = client_of(gateway, keys["b"])
    lines = [{"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": f"Say the number {i}.", "max_output_tokens": 4,
                       "temperature": 0}} for i in range(3)]
    batch = wait_for(client, submit(client, lines, "/v1/responses").id, finished)
    output = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in output] == ["resp-0", "resp-1", "resp-2"]
    bodies = [o["response"]["body"] for o in output]
    assert all(b["object"] == "response" and b["output"] for b in bodies)
    usage = usage_of(gateway, keys["b"], batch.id)
    assert usage["input_tokens"] == sum(b["usage"]["input_tokens"] for b in bodies) > 0
    assert usage["output_tokens"] == sum(b["usage"]["output_tokens"] for b in bodies) > 0


def test_cli_runs_a_file_to_its_output(gateway, keys, worker, tmp_path):
    worker()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(numbered_lines(5)))
    env = {**os.environ, "CONVEYOR_BATCH_GATEWAY_URL": f"http://127.0.0.1:{gateway.port}",
           "CONVEYOR_BATCH_API_KEY": keys["a"]}
    command = [sys.executable, "-m", "conveyor.batch"]
    run = subprocess.run([*command, "run", str(source), "-o", str(target)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["custom_id"] for line in target.read_text().splitlines()] == [
        f"req-{i}" for i in range(5)]
    batch_id = run.stdout.split(":")[0]
    assert "5/5" in run.stderr  # the progress bar's last state
    status = subprocess.run([*command, "status", batch_id], env=env, capture_output=True,
                            text=True, timeout=60)
    assert json.loads(status.stdout)["status"] == "completed"


async def test_interactive_requests_go_before_batch_lines(launch, files_dir, keys, worker):
    from conveyor.common.grpc_client import open_channel
    from conveyor.gateway.clients.engine import EngineClient

    [engine] = launch.engines("engine-batch-2-seats", MAX_NUM_SEQS="2")
    gateway = launch.gateway("gateway-batch-2-seats", CONVEYOR_GATEWAY_AUTH_ENABLED="true",
                             CONVEYOR_GATEWAY_ENGINE_ADDRESSES=engine.address,
                             CONVEYOR_GATEWAY_BATCH_TOKEN=TOKEN,
                             CONVEYOR_GATEWAY_FILES_DIR=str(files_dir))
    client = client_of(gateway, keys["a"])
    worker(gateway)  # 8 lines in flight: 2 run, 6 wait
    lines = [chat_line(f"long-{i}", f"Tell story {i}.", 48, ignore_eos=True) for i in range(12)]
    batch = submit(client, lines)
    channel = open_channel(engine.address)
    stats = EngineClient(engine.address, channel, rpc_timeout_s=5).stats
    deadline = time.monotonic() + 120
    while (s := await stats()).num_running < 2 or s.num_waiting < 4:
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.02)
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].finish_reason == "length"
    assert client.batches.retrieve(batch.id).request_counts.completed <= 2
    await channel.close()
    client.batches.cancel(batch.id)
    assert wait_for(client, batch.id, finished, timeout_s=120).status == "cancelled"


async def test_cancel_mid_batch_keeps_finished_lines_and_frees_the_pool(gateway, keys, worker,
                                                                        idle_engine):
    worker()
    client = client_of(gateway, keys["a"])
    batch = submit(client, numbered_lines(200, max_tokens=24))
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 10)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_for(client, batch.id, finished, timeout_s=60)
    assert batch.status == "cancelled" and batch.cancelled_at
    output = read_lines(client, batch.output_file_id)
    assert 10 <= len(output) == batch.request_counts.completed < 200
    assert [o["custom_id"] for o in output] == sorted(
        (o["custom_id"] for o in output), key=lambda c: int(c.split("-")[1]))
    stats = await idle_engine(timeout_s=10)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_bad_uploads_and_batch_requests(gateway, keys):
    client = client_of(gateway, keys["a"])
    with pytest.raises(openai.BadRequestError) as error:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert error.value.body["param"] == "purpose"
    big = client.files.create(file=("big.jsonl", b"x" * (5 * 1024 * 1024)), purpose="batch")
    assert big.bytes == 5 * 1024 * 1024
    with pytest.raises(openai.APIStatusError) as error:
        client.files.create(file=("huge.jsonl", b"x" * (UPLOAD_LIMIT + 1)), purpose="batch")
    assert error.value.status_code == 413 and error.value.body["code"] == "file_too_large"
    assert big.id in [f.id for f in client.files.list()]
    uploaded = client.files.create(file=("in.jsonl", jsonl(numbered_lines(1))), purpose="batch")
    for change, param in (({"endpoint": "/v1/embeddings"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window")):
        args = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as error:
            client.batches.create(**args)
        assert error.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nosuchfile", endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert client.files.delete(big.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(big.id)


def test_bad_lines_fail_the_batch_with_line_numbers(gateway, keys, worker):
    worker()
    client = client_of(gateway, keys["a"])
    good = chat_line("one", "Hi")
    raw = b"\n".join([
        json.dumps(good).encode(), b"{not json", json.dumps(good).encode(),
        json.dumps({**good, "custom_id": "two", "url": "/v1/completions"}).encode(),
        json.dumps(chat_line("three", "Hi", stream=True)).encode()]) + b"\n"
    uploaded = client.files.create(file=("bad.jsonl", raw), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_for(client, batch.id, finished, timeout_s=60)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("mismatched_endpoint", 4),
        ("invalid_request", 5)]


def test_failed_lines_go_to_the_error_file(gateway, keys, worker):
    worker()
    client = client_of(gateway, keys["a"])
    too_long = " ".join(["word"] * 3000)
    lines = [chat_line("ok", "Hi"), chat_line("too-long", too_long)]
    batch = wait_for(client, submit(client, lines).id, finished)
    assert batch.status == "completed"
    assert batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    assert [o["custom_id"] for o in read_lines(client, batch.output_file_id)] == ["ok"]
    [error] = read_lines(client, batch.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"

    all_bad = [chat_line(f"bad-{i}", "Hi", model="no-such-model") for i in range(3)]
    batch = wait_for(client, submit(client, all_bad).id, finished)
    assert batch.status == "completed" and batch.request_counts.failed == 3
    assert batch.output_file_id is not None
    assert client.files.content(batch.output_file_id).content == b""
    errors = read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad-0", "bad-1", "bad-2"]
    assert all(e["response"]["status_code"] == 404 for e in errors)


def test_tenants_are_isolated_and_batch_lines_skip_interactive_limits(gateway, keys, worker):
    worker()
    owner, other = client_of(gateway, keys["a"]), client_of(gateway, keys["b"])
    batch = submit(owner, numbered_lines(2))
    for call in (lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.files.retrieve(batch.input_file_id),
                 lambda: other.files.content(batch.input_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.input_file_id not in [f.id for f in other.files.list()]
    assert wait_for(owner, batch.id, finished).status == "completed"

    free = client_of(gateway, keys["free"])  # 10 requests/minute, 2 at once
    lines = numbered_lines(24)
    batch = wait_for(free, submit(free, lines).id, finished)
    assert batch.status == "completed"
    assert_each_line_once(free, gateway, keys["free"], batch, lines)
    assert batch.id in [b.id for b in free.batches.list(limit=5)]
    metrics = httpx.get(f"http://127.0.0.1:{gateway.port}/metrics").text
    assert 'conveyor_gateway_batches{status="completed"}' in metrics
    assert 'conveyor_gateway_batch_lines_total{outcome="completed"}' in metrics
