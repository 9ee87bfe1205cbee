"""Offline throughput: Conveyor's `LLM.generate` against transformers `generate` with static
batching, on the same prompts, at several batch sizes, in one run.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.offline_throughput

For each batch size B both sides get the same B prompts (distinct per B, so no run
reuses another's prefix cache) and generate exactly --output-len tokens per prompt
(ignore EOS), greedy, fp32 on the CPU. transformers runs the B prompts as one
left-padded batch; Conveyor gets them in one `generate` call and batches them
continuously. Output tokens/s = B x output-len / wall time (prefill included).
Writes a markdown table to --out (docs/benchmarks-offline.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORDS = ("river market apple engine silver garden window story number yellow mountain "
         "quiet paper bridge winter music ocean forest letter morning village table "
         "machine travel summer candle orange friend castle pencil thunder rabbit").split()


@dataclass(slots=True)
class Row:
    batch_size: int
    conveyor_tps: float
    hf_tps: float

    @property
    def ratio(self) -> float:
        return self.conveyor_tps / self.hf_tps


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """`count` distinct prose-like prompts of 16-128 tokens, as token ids."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(12, 100))]
        ids = tokenizer(" ".join(words).capitalize() + ".", add_special_tokens=False)["input_ids"]
        prompts.append(ids[:128])
    return prompts


def conveyor_tokens_per_s(llm, prompts: list[list[int]], output_len: int) -> float:
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def hf_tokens_per_s(model, tokenizer, prompts: list[list[int]], output_len: int) -> float:
    """One static, left-padded batch through `generate`."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                             max_new_tokens=output_len, min_new_tokens=output_len)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def run(args) -> list[Row]:
    import torch

    from bench.baselines.hf_model import load_hf_model
    from conveyor.engine import LLM

    torch.set_num_threads(args.threads)
    hf_model, tokenizer = load_hf_model(args.model)
    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes), kv_cache_gib=args.kv_cache_gib,
              max_model_len=1024, torch_threads=args.threads)
    warmup = make_prompts(tokenizer, 2, seed=-1)
    conveyor_tokens_per_s(llm, warmup, 4)
    hf_tokens_per_s(hf_model, tokenizer, warmup, 4)
    rows = []
    for batch_size in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch_size, seed=batch_size)
        conveyor = conveyor_tokens_per_s(llm, prompts, args.output_len)
        hf = hf_tokens_per_s(hf_model, tokenizer, prompts, args.output_len)
        rows.append(Row(batch_size, conveyor, hf))
        print(f"batch {batch_size:3d}: conveyor {conveyor:8.1f} tok/s   "
              f"transformers {hf:8.1f} tok/s   ratio {rows[-1].ratio:5.2f}x", flush=True)
    return rows


def markdown(rows: list[Row], args, command: str) -> str:
    import torch

    lines = [
        "# Offline throughput: Conveyor `LLM.generate` vs transformers `generate`",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model} (fp32, CPU), {args.output_len} output tokens per prompt (ignore "
        f"EOS, greedy), prompts of 16-128 tokens, distinct per batch size. transformers runs "
        f"each batch as one left-padded static batch; Conveyor runs the same prompts in one "
        f"`generate` call with continuous batching. torch {torch.__version__}, "
        f"{args.threads} thread(s), {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}), "
        f"shared with other work at the time of the run.",
        "",
        "| batch | Conveyor (output tok/s) | transformers (output tok/s) | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.batch_size} | {r.conveyor_tps:.1f} | {r.hf_tps:.1f} | {r.ratio:.2f}x |"
              for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (the same for a fair comparison)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks-offline.md"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = " ".join(["HF_HUB_OFFLINE=1 .venv/bin/python -m bench.offline_throughput", *argv])
    print(command, flush=True)
    rows = run(args)
    text = markdown(rows, args, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
