"""`make compose-check`: the images and the CPU compose stack, proven by running them.

Builds every service's image (docker when its daemon answers, else podman with podman-compose
from the dev requirements), one at a time; starts docker-compose.yml + docker-compose.cpu.yml;
waits for every health check (podman without systemd never runs them itself: the check runs
`podman healthcheck run` in a loop); creates a tenant key with the gateway's tenancy command;
streams a chat completion and runs a batch of 5 lines through the Batch API until the worker has
completed it (official openai SDK); checks that a trace from the gateway through the engine
reached the collector and that the CPU engine image has no triton; tears the stack down
(volumes too) and prints one summary line. Exit status 1 on any failure, with the containers'
last log lines.

Where no registry answers, the images it cannot pull are replaced by stand-ins (standins.py),
and the output names each one. Logs: .run-logs/compose-check/. Not in CI (too heavy): run it
before handing in a change to a Dockerfile, a compose file or a dependency.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import standins
import yaml

ROOT = standins.ROOT
LOGS = standins.LOGS
PROJECT = "conveyor-check"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
BUILT = ("gateway", "batch", "tokenizer", "detok", "engine")
"""The images built from this tree, cheapest first."""
PORTS = (8000, 16686, 4317, 4318)
"""What the stack publishes on this machine."""
MODEL = "smollm2-135m-instruct"
API = "http://127.0.0.1:8000/v1"
TRACES = "http://127.0.0.1:16686/api/traces"
MIN_DOCKER_COMPOSE = (2, 24)  # reads `!reset`
MIN_PODMAN_COMPOSE = (1, 4)


class CheckFailed(Exception):
    """A step failed; the message says what was seen."""


@dataclass(frozen=True)
class Tools:
    engine: str  # "docker" or "podman"
    compose: tuple[str, ...]
    description: str


def find_tools() -> Tools:
    if shutil.which("docker") and _quiet(["docker", "info"]).returncode == 0:
        version = _version(_quiet(["docker", "compose", "version", "--short"]).stdout)
        _require(version >= MIN_DOCKER_COMPOSE, f"docker compose {_dotted(version)} cannot read "
                 f"the CPU overlay's `!reset`: it needs >= {_dotted(MIN_DOCKER_COMPOSE)}")
        return Tools("docker", ("docker", "compose"), f"docker compose {_dotted(version)}")
    podman_compose = Path(sys.executable).with_name("podman-compose")
    _require(shutil.which("podman") and podman_compose.exists(),
             "no Docker daemon answers and podman or podman-compose is missing: "
             "scripts/compose_check/setup_podman.sh (as root) and `make setup`")
    version = _version(_quiet([str(podman_compose), "version"]).stdout)
    _require(version >= MIN_PODMAN_COMPOSE, f"podman-compose {_dotted(version)} cannot read "
             f"`!reset`: it needs >= {_dotted(MIN_PODMAN_COMPOSE)}")
    podman = _dotted(_version(_quiet(["podman", "--version"]).stdout))
    return Tools("podman", (str(podman_compose),),
                 f"podman {podman}, podman-compose {_dotted(version)}")


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _version(text: str) -> tuple[int, ...]:
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    _require(found, f"no version in {text!r}")
    return tuple(int(part) for part in found.groups() if part)


def _quiet(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _require(condition, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Stack:
    """The compose project: its files (with the check's override) and its containers."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.override = LOGS / "compose.check.yml"

    def compose(self, *args: str, log: Path | None = None) -> None:
        files = [a for f in (*COMPOSE_FILES, self.override) for a in ("-f", str(f))]
        build = standins.build_options(self.tools.engine)
        podman_args = ["--podman-build-args", " ".join(build)] if build else []
        command = [*self.tools.compose, "-p", PROJECT, *files, *podman_args, *args]
        with open(log or LOGS / "compose.log", "a") as out:
            done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _require(done.returncode == 0, f"`{' '.join(command[-2:])}` failed (see {out.name})")

    def containers(self) -> dict[str, dict]:
        """service -> the container's `inspect` object."""
        ids = _quiet([self.tools.engine, "ps", "-aq", "--filter",
                      f"label=com.docker.compose.project={PROJECT}"]).stdout.split()
        found = json.loads(_quiet([self.tools.engine, "inspect", *ids]).stdout) if ids else []
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in found}

    def is_healthy(self, container: dict) -> bool:
        name = container["Name"].lstrip("/")
        if self.tools.engine == "podman":  # no systemd timer runs the check: run it here
            return _quiet(["podman", "healthcheck", "run", name]).returncode == 0
        return container["State"].get("Health", {}).get("Status") == "healthy"

    def exec(self, service: str, *command: str) -> str:
        name = self.containers()[service]["Name"].lstrip("/")
        done = _quiet([self.tools.engine, "exec", name, *command])
        _require(done.returncode == 0, f"{service}: {' '.join(command)}: {done.stderr}")
        return done.stdout

    def logs(self, lines: int = 30) -> str:
        """The last `lines` of every container's output (stdout and stderr)."""
        return "\n".join(
            f"--- {service}\n" + subprocess.run(
                [self.tools.engine, "logs", "--tail", str(lines), c["Name"].lstrip("/")],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
            for service, c in self.containers().items())


def image_name(service: str) -> str:
    return f"localhost/conveyor-check/{service}"


def prepare_images(tools: Tools) -> tuple[dict, list[str]]:
    """The override naming every image, and which images are stand-ins."""
    compose = yaml.safe_load((ROOT / COMPOSE_FILES[0]).read_text())["services"]
    base = standins.python_base(tools.engine)
    redis = standins.redis(tools.engine, compose["redis"]["image"])
    jaeger = standins.jaeger(tools.engine, compose["jaeger"]["image"])
    services = {service: {"image": image_name(service)} for service in BUILT}
    services["redis"] = {"image": redis.reference}
    services["jaeger"] = {"image": jaeger.reference}
    if jaeger.command:
        services["jaeger"]["command"] = jaeger.command
    named = {"python:3.11-slim": base, "redis": redis, "jaeger": jaeger}
    for name, image in named.items():
        print(f"  {name}: {image.reference} ({'stand-in: ' * image.is_standin}{image.origin})")
    return {"services": services}, [f"{n} ({i.origin})" for n, i in named.items() if i.is_standin]


def build_images(stack: Stack) -> dict[str, tuple[float, int]]:
    """service -> (build seconds, image bytes)."""
    built = {}
    for service in BUILT:
        start = time.monotonic()
        stack.compose("build", service, log=LOGS / f"build-{service}.log")
        size = int(_quiet([stack.tools.engine, "image", "inspect", "--format", "{{.Size}}",
                           image_name(service)]).stdout)
        built[service] = (time.monotonic() - start, size)
        print(f"  {service}: {_duration(built[service][0])}, {size / 1e9:.2f} GB")
    return built


def check_engine_has_no_triton(tools: Tools) -> None:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)"
    done = _quiet([tools.engine, "run", "--rm", image_name("engine"), "python", "-c", probe])
    _require(done.returncode == 0, f"the CPU engine image carries triton {done.stderr}")


def check_ports_free() -> None:
    for port in PORTS:
        with socket.socket() as sock:
            _require(sock.connect_ex(("127.0.0.1", port)) != 0,
                     f"port {port} is taken on this machine; the stack publishes {PORTS}")


def wait_until_healthy(stack: Stack, timeout_s: float = 900) -> float:
    """Seconds until every container with a health check is healthy and the rest run."""
    start = time.monotonic()
    healthy: set[str] = set()
    while True:
        containers = stack.containers()
        for service, container in containers.items():
            _require(container["State"]["Status"] == "running",
                     f"{service} is {container['State']['Status']}")
            if service not in healthy and container["Config"].get("Healthcheck") \
                    and stack.is_healthy(container):
                healthy.add(service)
                print(f"  {service} healthy after {time.monotonic() - start:.0f}s")
        checked = {s for s, c in containers.items() if c["Config"].get("Healthcheck")}
        if checked and checked <= healthy:
            return time.monotonic() - start
        _require(time.monotonic() - start < timeout_s,
                 f"not healthy after {timeout_s:.0f}s: {sorted(checked - healthy)}")
        time.sleep(2)


def stream_chat(client: openai.OpenAI) -> str:
    start = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=32, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    finish = chunks[-1].choices[0].finish_reason if chunks else None
    _require(text and finish, f"stream ended without text or finish_reason: {chunks}")
    return f"{len(chunks)} chunks in {time.monotonic() - start:.1f}s ({finish}): {text!r}"


def run_batch(client: openai.OpenAI, num_lines: int = 5, timeout_s: float = 600) -> str:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST",
                         "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 16, "messages": [
                             {"role": "user", "content": f"Count to {i + 1}."}]}})
             for i in range(num_lines)]
    upload = client.files.create(file=("check.jsonl", "\n".join(lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    start = time.monotonic()
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        _require(time.monotonic() - start < timeout_s,
                 f"batch {batch.id} still {batch.status} after {timeout_s:.0f}s")
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    _require(batch.status == "completed" and counts.completed == num_lines,
             f"batch {batch.id}: {batch.status}, {counts}, errors {batch.errors}")
    results = [json.loads(line) for line in
               client.files.content(batch.output_file_id).text.splitlines()]
    _require(sorted(r["response"]["status_code"] for r in results) == [200] * num_lines,
             f"output lines: {results}")
    return f"{num_lines}/{num_lines} lines completed in {time.monotonic() - start:.0f}s"


def find_trace(timeout_s: float = 60) -> str:
    """A trace of the gateway that reached the engine, as the collector's query API has it."""
    start = time.monotonic()
    while True:
        response = httpx.get(TRACES, params={"service": "gateway", "lookback": "1h",
                                             "limit": 50}, timeout=10)
        for trace in response.json().get("data") or []:
            services = {trace["processes"][span["processID"]]["serviceName"]
                        for span in trace["spans"]}
            if {"gateway", "engine"} <= services:
                return f"trace {trace['traceID'][:12]} spans {', '.join(sorted(services))}"
        _require(time.monotonic() - start < timeout_s,
                 f"no trace from the gateway through the engine after {timeout_s:.0f}s")
        time.sleep(2)


def _duration(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def run_check(stack: Stack, summary: list[str], notes: list[str]) -> None:
    print("== base images")
    override, replaced = prepare_images(stack.tools)
    stack.override.write_text(yaml.safe_dump(override))
    notes.extend(replaced)
    print("== building images (one at a time)")
    built = build_images(stack)
    check_engine_has_no_triton(stack.tools)
    summary.append(f"{len(built)} images built in {_duration(sum(t for t, _ in built.values()))}"
                   f" (CPU engine {built['engine'][1] / 1e9:.2f} GB, no triton)")
    print("== starting the CPU stack")
    stack.compose("down", "-v")  # what an interrupted run left
    check_ports_free()
    stack.compose("up", "-d", "--no-build")
    summary.append(f"stack healthy in {wait_until_healthy(stack):.0f}s")
    key = stack.exec("gateway", "python", "-m", "conveyor.gateway.tenancy", "create",
                     "--tenant", "compose-check", "--tier", "standard").strip()
    _require(key, "the tenancy command printed no key")
    print("  tenant key created")
    summary.append("tenant key created")
    client = openai.OpenAI(base_url=API, api_key=key, max_retries=0, timeout=120)
    chat = stream_chat(client)
    print(f"== chat (streamed): {chat}")
    summary.append(f"chat streamed ({chat.split(' (')[0]})")
    batch = run_batch(client)
    print(f"== batch: {batch}")
    summary.append(f"batch of 5 completed by the worker ({batch.split(' in ')[1]})")
    trace = find_trace()
    print(f"== collector: {trace}")
    summary.append(f"trace received ({trace.split(' spans ')[1]})")


def tear_down(stack: Stack) -> str | None:
    """None, or why the stack could not be taken down."""
    print("== tearing down")
    try:
        stack.compose("down", "-v")
    except CheckFailed as failure:
        return str(failure)
    return None


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / "compose.log").unlink(missing_ok=True)
    summary: list[str] = []
    notes: list[str] = []
    failure = stack = None
    try:
        tools = find_tools()
        print(f"== compose-check with {tools.description}")
        summary.append(tools.description)
        stack = Stack(tools)
        run_check(stack, summary, notes)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - all fail, after teardown
        failure = f"{type(error).__name__}: {error}"
        if stack:
            print(stack.logs())
    if stack and stack.override.exists():
        teardown_failure = tear_down(stack)
        failure = failure or teardown_failure
    result = f"FAILED: {failure}" if failure else "OK"
    notes = [f"stand-ins: {', '.join(notes)}"] if notes else []
    print(f"compose-check: {result}: {'; '.join(summary + notes)}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
