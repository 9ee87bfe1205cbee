"""Python gRPC's own CPU per streamed message: the floor under every hop a token takes.

A server process streams `--messages` 40-byte messages to this process, one every
`--gap-ms` (a token's pace at concurrency 1), over each transport: grpc.aio over TCP
loopback, grpc.aio over a Unix-domain socket, and the thread-pool (sync) API over TCP.
Reported per arm: CPU microseconds a message on the sending and on the receiving side (from
/proc and getrusage, the stream's first 50 messages left out), medians over rounds in
rotating order. A token crosses two gRPC streams (engine -> detok -> gateway): four of
these sides.

    .venv/bin/python -m bench grpc-message [--messages 1000] [--gap-ms 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc

from bench import arms
from bench.ab import REPO_ROOT
from bench.suite.cpu_time import snapshot, spent
from devkit.ports import free_port

ARMS = ("aio tcp", "aio unix", "sync tcp")
WARM_UP = 50
_METHOD = "/bench.Tokens/Stream"


def _handler(stream) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Tokens", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})


def serve(arm: str, address: str, messages: int, gap_s: float) -> None:
    """The sending side: serve until stdin closes ("ready" on stdout once listening)."""
    if arm.startswith("sync"):
        def stream(request, context):
            for _ in range(messages):
                time.sleep(gap_s)
                yield b"t" * 40
        server = grpc.server(futures.ThreadPoolExecutor(4), handlers=(_handler(stream),))
        server.add_insecure_port(address)
        server.start()
        print("ready", flush=True)
        sys.stdin.read()
        server.stop(0)
        return

    async def stream(request, context):
        for _ in range(messages):
            await asyncio.sleep(gap_s)
            yield b"t" * 40

    async def run() -> None:
        server = grpc.aio.server(handlers=(_handler(stream),))
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(0)
    asyncio.run(run())


class _Tally:
    """Counts one stream's messages; CPU of both sides from the end of the warm-up on."""

    def __init__(self, sender: int) -> None:
        self.sender, self.received, self.before = sender, 0, None

    def tick(self) -> None:
        self.received += 1
        if self.received == WARM_UP:
            self.before = snapshot({"send": self.sender})

    def figures(self) -> arms.Sample:
        cpu, counted = spent(self.before, snapshot({"send": self.sender})), self.received - WARM_UP
        return {"send us/message": 1e6 * cpu["send"] / counted,
                "receive us/message": 1e6 * cpu["client"] / counted}


def _receive(arm: str, address: str, sender: int) -> arms.Sample:
    """Read one stream (this process is the receiving side)."""
    tally = _Tally(sender)
    if arm.startswith("sync"):
        with grpc.insecure_channel(address) as channel:
            for _ in channel.unary_stream(_METHOD)(b""):
                tally.tick()
        return tally.figures()

    async def read() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            async for _ in channel.unary_stream(_METHOD)(b""):
                tally.tick()
    asyncio.run(read())
    return tally.figures()


def measure(arm: str, messages: int, gap_s: float) -> arms.Sample:
    with tempfile.TemporaryDirectory() as folder:
        address = (f"unix://{folder}/grpc.sock" if arm.endswith("unix")
                   else f"127.0.0.1:{free_port()}")
        with subprocess.Popen([sys.executable, "-m", "bench.grpc_message", "--serve", arm,
                               address, str(messages), str(gap_s)], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as server:
            try:
                if server.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the {arm} server did not start")
                return _receive(arm, address, server.pid)
            finally:
                server.stdin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    args = parser.parse_args()
    if args.messages <= WARM_UP:
        parser.error(f"--messages must be over {WARM_UP} (the warm-up messages)")
    rounds = arms.run_rounds(ARMS, args.rounds,
                             lambda arm: measure(arm, args.messages, args.gap_ms / 1e3))
    print(json.dumps({"messages": args.messages, "gap_ms": args.gap_ms, "rounds": args.rounds,
                      "cpus": os.cpu_count(), **rounds.summary("aio tcp", "send us/message",
                                                               "receive us/message")},
                     indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        arm, address, messages, gap_s = sys.argv[2:6]
        serve(arm, address, int(messages), float(gap_s))
    else:
        main()
