"""Single-stream decode of the offline engine run from the main thread or from another one.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.torch_thread [--rounds 3]

Each case runs in a fresh process (alternating over rounds): `main` (the engine built and
stepped on the main thread), `thread` (built and stepped on one other thread, as the engine
server's loop thread does now), `main-pool-then-thread` (the main thread runs one parallel
torch op first, then another thread builds and steps the engine: two libgomp pools, as when the
server built the core on an asyncio executor thread). Prints prefill ms of a 256-token prompt
and decode TPOT of 64 tokens (docs/performance.md, "One thread for the engine's torch work").
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time

CASES = ("main", "thread", "main-pool-then-thread")


def decode_once(seed: int) -> tuple[float, float]:
    """(prefill s, TPOT s) of one 256-token prompt with 64 greedy output tokens."""
    from bench.inprocess_engine import make_llm
    from conveyor.engine.sampling_params import SamplingParams

    llm, rng = make_llm(), random.Random(seed)

    def timed(max_tokens: int) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(256)]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True))
        return time.perf_counter() - start

    timed(4)  # warm-up
    prefill, whole = timed(1), timed(65)
    return prefill, (whole - prefill) / 64


def run_case(case: str) -> None:
    import torch

    out: list[tuple[float, float]] = []
    if case == "main":
        out.append(decode_once(0))
    else:
        if case == "main-pool-then-thread":
            torch.add(torch.randn(1_000_000), 1.0)  # a parallel region on the main thread
        thread = threading.Thread(target=lambda: out.append(decode_once(0)))
        thread.start()
        thread.join()
    prefill, tpot = out[0]
    print(f"{case:22s} threads {torch.get_num_threads()}  prefill {prefill * 1e3:7.1f} ms  "
          f"TPOT {tpot * 1e3:6.2f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args()
    if args.case:
        run_case(args.case)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      os.environ.get("PYTHONPATH")]))}
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(args.rounds):
        for case in CASES:
            subprocess.run([sys.executable, "-m", "bench.torch_thread", "--case", case],
                           env=env, check=True)


if __name__ == "__main__":
    main()
