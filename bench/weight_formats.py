"""The opt-in weight formats (CONVEYOR_ENGINE_WEIGHT_FORMAT) side by side: speed and accuracy.

For each format, in one process and one run (an A/B, rounds interleaved):
- single-stream decode TPOT of the offline engine (median over rounds of the p50 over a
  request's tokens; a 256-token prompt, prefill in fp32 as in serving);
- greedy agreement with fp32 over 16 fixed prompts x 64 tokens: the share of tokens equal
  before the first divergence, and the share of positions equal overall;
- perplexity on a fixed text (bench/texts/pride_and_prejudice_ch1.txt, one forward pass).
For the two accuracy figures every step reads the format (its row limit lifted), so they
show the whole cost of the format, not the mix of fp32 prefill and quantized decode that
serving runs; per row a quantized layer computes the same at any row count.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench weight-formats [--formats fp32,fp16,q8_0,q4_1]
        [--threads 2] [--rounds 3] [--decode-tokens 64] [--rows 1,2,4,8,16] [--json PATH]

`q4_1/avx2` forces the AVX2 code path of the block kernels. A `+kv16` suffix (`fp32+kv16`)
runs the format over an fp16 KV pool (CONVEYOR_ENGINE_KV_CACHE_DTYPE=float16): its accuracy
columns are then the cost of the rounded keys and values (with the format's own). `bf16` is the
model in bfloat16 (CONVEYOR_ENGINE_DTYPE=bfloat16, what dtype auto picks on a CPU with
AVX512-BF16 or AMX: bf16 weights, activations and KV pool); every other format runs in float32.
A kernel change is compared across revisions by the one A/B runner, e.g. `python -m bench
offline --scenario c1 --variant old@REV=CONVEYOR_ENGINE_WEIGHT_FORMAT=q4_1 --variant
new=CONVEYOR_ENGINE_WEIGHT_FORMAT=q4_1`.

--rows adds a kernel table: one forward pass's linear layers at each row count, per format
(this is what DECODE_MAX_ROWS was chosen from).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "texts" / "pride_and_prejudice_ch1.txt"
PROMPTS = (
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "def quicksort(arr):\n    ",
    "Explain photosynthesis to a ten-year-old.",
    "1, 1, 2, 3, 5, 8, 13,",
    "The three most important inventions of the nineteenth century were",
    "Translate into French: The weather is lovely today.",
    "List five fruits that are red:",
    "Once upon a time, in a village at the edge of a forest,",
    "What is the difference between a list and a tuple in Python?",
    "The best way to learn a new language is",
    "Give me a recipe for pancakes.",
    "import numpy as np\n\n# compute the mean of each row\n",
    "Why is the sky blue?",
    "Dear hiring manager, I am writing to apply for",
    "The history of the Roman Empire begins",
)
NUM_AGREEMENT_TOKENS = 64
PROMPT_LEN = 256


def build_llm(weight_format: str, threads: int):
    """The offline engine reading `weight_format`: FORMAT, FORMAT/avx2 (the AVX2 code path
    of its block kernels) or either with an fp16 KV pool (+kv16)."""
    from conveyor.engine import LLM
    from conveyor.engine.model.block_weights import ISA_AVX2

    weight_format, kv16, _ = weight_format.partition("+kv16")
    base, _, isa = weight_format.partition("/")
    dtype = "bfloat16" if base == "bf16" else "float32"
    llm = LLM(weight_format="fp32" if base == "bf16" else base, dtype=dtype,
              torch_threads=threads, num_kv_blocks=512, max_num_seqs=16,
              enable_prefix_caching=False, kv_cache_dtype="float16" if kv16 else "auto")
    if isa == "avx2":
        for layer in quantized_layers(llm):
            layer.weights.isa = ISA_AVX2
    return llm

def quantized_layers(llm):
    from conveyor.engine.model.quantized_linear import QuantizedLinear

    return [m for m in llm.core.runner.model.modules() if isinstance(m, QuantizedLinear)]


def decode_weight_bytes(llm) -> int:
    """Bytes of linear-layer weights a one-row step reads (fp32: the CpuLinears')."""
    from conveyor.engine.model.cpu_linear import CpuLinear
    from conveyor.engine.model.quantized_linear import QuantizedLinear

    total = 0
    for module in llm.core.runner.model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weights.nbytes
        elif isinstance(module, CpuLinear) and not _is_dense_of_quantized(llm, module):
            total += module.weight.nbytes
    return total


def _is_dense_of_quantized(llm, layer) -> bool:
    return any(q.dense is layer for q in quantized_layers(llm))


def set_max_rows(llm, rows: int) -> None:
    for layer in quantized_layers(llm):
        layer.max_rows = rows


def decode_tpot_ms(llm, prompt_ids: list[int], num_tokens: int) -> float:
    from bench.inprocess_engine import run_inprocess
    from bench.serving.workload import BenchRequest

    request = BenchRequest(prompt=prompt_ids, prompt_len=len(prompt_ids), max_tokens=num_tokens)
    metrics, _ = run_inprocess(llm, [request], concurrency=1)
    return metrics.tpot.p50


def greedy_outputs(llm) -> list[list[int]]:
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_AGREEMENT_TOKENS, ignore_eos=True)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before the first divergence, share of equal positions)."""
    prefix = same = total = 0
    for a, b in zip(ours, reference, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix += first
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(b)
    return prefix / total, same / total


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] in one prefill step."""
    from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    runner = llm.core.runner
    block_size = runner.config.block_size
    blocks = list(range(math.ceil(len(token_ids) / block_size)))
    slots = [blocks[p // block_size] * block_size + p % block_size
             for p in range(len(token_ids))]
    request = ScheduledRequest(
        request_id="ppl", token_ids=list(token_ids), num_computed_tokens=0,
        block_table=blocks, slot_mapping=slots, needs_sample=True,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
        prompt_token_ids=list(token_ids), output_token_ids=[])
    step = SchedulerOutput(scheduled=[request], block_size=block_size)
    with torch.inference_mode():
        inputs = runner.inputs.build(step)
        hidden = runner._forward(inputs)()
        logits = runner.model.compute_logits(hidden).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))


def kernel_table(llms: dict, rows_list: list[int], repeats: int = 5) -> list[dict]:
    """ms for every linear layer of one forward pass (lm_head included) at each row count."""
    table = []
    for rows in rows_list:
        for name, llm in llms.items():
            model = llm.core.runner.model
            layers = [m for n, m in model.named_modules()
                      if type(m).__name__ in ("CpuLinear", "QuantizedLinear")
                      and not n.endswith(".dense")]
            for layer in quantized_layers(llm):
                layer.max_rows = max(rows_list)
            inputs = {id(m): torch.randn(rows, m.in_features,  # a format's model runs fp32
                                         dtype=torch.float32 if hasattr(m, "weights")
                                         else m.weight.dtype)
                      for m in layers}
            times = []
            with torch.inference_mode():
                for _ in range(repeats):
                    start = time.perf_counter()
                    for m in layers:
                        m(inputs[id(m)])
                    times.append(time.perf_counter() - start)
            table.append({"format": name, "rows": rows, "ms": 1e3 * statistics.median(times)})
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="fp32,fp16,q8_0,q4_1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rows", default="", help="e.g. 1,2,4,8,16: add the kernel table")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    formats = args.formats.split(",")
    if formats[0] != "fp32":
        formats.insert(0, "fp32")
    torch.set_num_threads(args.threads)
    llms = {fmt: build_llm(fmt, args.threads) for fmt in formats}
    tokenizer = llms["fp32"].get_tokenizer()
    text_ids = tokenizer(TEXT.read_text())["input_ids"]
    prompt_ids = text_ids[:PROMPT_LEN]

    tpots: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for _ in range(args.rounds):
        for fmt, llm in llms.items():
            tpots[fmt].append(decode_tpot_ms(llm, prompt_ids, args.decode_tokens))

    results, reference = [], None
    for fmt, llm in llms.items():
        set_max_rows(llm, 1 << 30)
        outputs = greedy_outputs(llm)
        reference = reference or outputs
        prefix, overall = agreement(outputs, reference)
        results.append({
            "format": fmt, "tpot_ms": statistics.median(tpots[fmt]), "tpot_rounds_ms": tpots[fmt],
            "agreement_prefix": prefix, "agreement_overall": overall,
            "perplexity": perplexity(llm, text_ids), "text_tokens": len(text_ids),
            "decode_weight_mb": decode_weight_bytes(llm) / 1e6})
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": args.threads, "load_average": list(_load()),
              "command": "python -m bench weight-formats " + " ".join(argv or sys.argv[1:]),
              "results": results}
    if args.rows:
        report["kernels"] = kernel_table(llms, [int(r) for r in args.rows.split(",")])
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _load() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


def _print(report: dict) -> None:
    base = report["results"][0]["tpot_ms"]
    print(f"threads {report['threads']}, load {report['load_average'][0]:.2f}")
    print("| format | decode TPOT ms (rounds) | speed-up | agreement before first divergence "
          "| agreement overall | perplexity | decode weight MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in report["results"]:
        rounds = ", ".join(f"{t:.1f}" for t in r["tpot_rounds_ms"])
        mb = f"{r['decode_weight_mb']:.0f}"
        print(f"| {r['format']} | {r['tpot_ms']:.1f} ({rounds}) | {base / r['tpot_ms']:.2f}x "
              f"| {100 * r['agreement_prefix']:.1f}% | {100 * r['agreement_overall']:.1f}% "
              f"| {r['perplexity']:.3f} | {mb} |")
    if "kernels" in report:
        print("\n| rows | " + " | ".join(sorted({k["format"] for k in report["kernels"]})) + " |")
        by_rows: dict[int, dict[str, float]] = {}
        for k in report["kernels"]:
            by_rows.setdefault(k["rows"], {})[k["format"]] = k["ms"]
        for rows, cells in by_rows.items():
            print(f"| {rows} | " + " | ".join(f"{cells[f]:.1f} ms" for f in sorted(cells)) + " |")


if __name__ == "__main__":
    sys.exit(main())
