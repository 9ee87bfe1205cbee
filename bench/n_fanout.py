"""n samples of one prompt: one request with n (the engine's fan-out) against n requests of
the same prompt at once (what the gateway sent before GenerateRequest.n), in process.

Both arms run on one offline LLM (the bundled model, prefix caching on), alternating, each
prompt fresh (random ids, so no arm finds the other's blocks). Reported per arm: the prompt
tokens the model computed (prefix-cache queries minus hits) and the wall time of the whole
generation, median over --rounds after a warm-up round.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench n-fanout [--n 4] [--prompt-len 512] \\
        [--max-tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from bench import arms
from bench.inprocess_engine import make_llm
from bench.serving.workload import load_prompt_maker

ARMS = ("one request, n", "n requests")


def computed_prompt_tokens(llm) -> int:
    stats = llm.core.stats()
    return stats.prefix_cache_queries - stats.prefix_cache_hits


def main() -> None:
    from conveyor.engine import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = make_llm(enable_prefix_caching=True)
    maker, seeds = load_prompt_maker(), itertools.count()

    def measure(arm: str) -> arms.Sample:
        fan_out = arm == "one request, n"
        prompt = {"prompt_token_ids": maker.random_ids(args.prompt_len)}
        params = SamplingParams(n=args.n if fan_out else 1, temperature=1.0, seed=next(seeds),
                                max_tokens=args.max_tokens, ignore_eos=True)
        before, start = computed_prompt_tokens(llm), time.perf_counter()
        llm.generate([prompt] * (1 if fan_out else args.n), params, use_tqdm=False)
        return {"computed_prompt_tokens": computed_prompt_tokens(llm) - before,
                "wall_s": time.perf_counter() - start}

    rounds = arms.run_rounds(ARMS, args.rounds, measure)
    print(json.dumps({"n": args.n, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                      "rounds": args.rounds, **{arm: {
                          "computed_prompt_tokens": rounds.median(arm, "computed_prompt_tokens"),
                          "wall_s": rounds.median(arm, "wall_s", 3)} for arm in ARMS}}, indent=1))


if __name__ == "__main__":
    main()
