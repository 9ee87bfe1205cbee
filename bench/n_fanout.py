"""n samples of one prompt: one request with n (the engine's fan-out) against n requests of
the same prompt at once (what the gateway sent before GenerateRequest.n), in process.

Both arms run on one offline LLM (the bundled model, prefix caching on), alternating, each
prompt fresh (a random id prefix, so no arm finds the other's blocks). Reported per arm: the
prompt tokens the model computed (prefix-cache queries minus hits) and the wall time of the
whole generation, median over --rounds.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench n-fanout [--n 4] [--prompt-len 512] \
        [--max-tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from conveyor.engine import LLM, SamplingParams


def _computed_prompt_tokens(llm: LLM) -> int:
    stats = llm.core.stats()
    return stats.prefix_cache_queries - stats.prefix_cache_hits


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    before = _computed_prompt_tokens(llm)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return _computed_prompt_tokens(llm) - before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=True)
    rng = random.Random(0)
    results: dict[str, list[tuple[int, float]]] = {"one request, n": [], "n requests": []}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for arm in results:
            prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
            fixed = dict(temperature=1.0, seed=round_index, max_tokens=args.max_tokens,
                         ignore_eos=True)
            if arm == "one request, n":
                outcome = _run(llm, [prompt], SamplingParams(n=args.n, **fixed))
            else:
                outcome = _run(llm, [prompt] * args.n, SamplingParams(**fixed))
            if round_index:
                results[arm].append(outcome)
    report = {arm: {"computed_prompt_tokens": statistics.median(c for c, _ in runs),
                    "wall_s": round(statistics.median(t for _, t in runs), 3)}
              for arm, runs in results.items()}
    print(json.dumps({"n": args.n, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "rounds": args.rounds, **report}, indent=1))


if __name__ == "__main__":
    main()
