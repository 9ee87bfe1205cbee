"""Structured outputs in process (issue 29): what a JSON-schema constraint on every request
costs, what compiling costs, and whether compiling disturbs the streams that do not wait for it.

Three measurements on one offline LLM (the bundled model), each a same-run A/B with the arms
alternating over --rounds (after a warm-up round):
- c16 output tok/s, every request constrained by a typical JSON schema (a pydantic-style
  person: nested object, enum, array, number) vs the same requests unconstrained with
  ignore_eos and max_tokens set to the constrained arm's mean output length;
- compile time of that schema: cold (a new schema text each time) and cached;
- inter-token latency p50 / p99 of unconstrained c16 streams while slow grammars (a 2,000-field
  schema, ~0.1 s each, a new text each time) compile back to back on the compiler's thread,
  vs without, vs a thread at the same priority that only keeps a core busy (the control:
  what any second busy core costs the step loop on the machine).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench structured-outputs [--concurrency 16] \\
        [--num-requests 32] [--max-tokens 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import BenchRequest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Berlin"]},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "number": {"type": "integer"}},
            "required": ["street", "number"], "additionalProperties": False},
    },
    "required": ["name", "age", "height_m", "city", "hobbies", "address"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Boris", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ines", "Jonas",
         "Kenji", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]


def slow_schema(tag: int) -> dict:
    """A schema that takes ~0.1 s to compile (2,000 fields, each a pattern), titled `tag`."""
    return {"title": f"slow {tag}", "type": "object", "required": ["f0"], "properties": {
        f"f{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 20}}}x{i}"}
        for i in range(2000)}}


def person_requests(llm, count: int, max_tokens: int) -> list[BenchRequest]:
    tokenizer = llm.get_tokenizer()
    requests = []
    for i in range(count):
        question = f"Describe {NAMES[i % len(NAMES)]} (person {i}), a fictional person, as JSON."
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        requests.append(BenchRequest(ids, len(ids), max_tokens))
    return requests


def compile_times(compiler, structured_outputs_params, rounds: int) -> dict:
    """Median ms of compiling PERSON with a fresh title (cold) and as cached."""
    cold, cached = [], []
    for i in range(rounds):
        schema = {**PERSON, "title": f"person {time.time_ns()} {i}"}
        params = structured_outputs_params(json=json.dumps(schema))
        start = time.perf_counter()
        compiler.compile(params).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(params).result()
        cached.append(time.perf_counter() - start)
    return {"cold_ms": round(statistics.median(cold) * 1e3, 2),
            "cached_ms": round(statistics.median(cached) * 1e3, 4)}


class BusyLoad:
    """The control for CompileLoad: a thread at the compile threads' priority that only
    keeps one core busy (sha256 over 16 MB, the GIL released), no grammar involved: what
    any second busy core costs the step loop on this machine."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from conveyor.engine.structured.grammar_compiler import lower_thread_priority

        lower_thread_priority()
        data = bytes(16 << 20)
        while not self._stop.is_set():
            hashlib.sha256(data).digest()

    def __enter__(self) -> BusyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class CompileLoad:
    """Compiles slow grammars back to back on a compiler of its own (same tokenizer, its own
    thread) until stopped: the engine loop never waits for them."""

    def __init__(self, compiler_factory, structured_outputs_params) -> None:
        self.compiler = compiler_factory()
        self.text = json.dumps(slow_schema(time.time_ns()))
        self.params = structured_outputs_params
        self.num_compiled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            text = self.text + " " * self.num_compiled  # new text, same schema
            self.compiler.compile(self.params(json=text)).result()
            self.num_compiled += 1

    def __enter__(self) -> CompileLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.compiler.close()


def timed_run(llm, requests, concurrency: int, **options):
    """run_inprocess plus the process CPU seconds it took (less sensitive than wall time to
    other processes on a shared machine)."""
    cpu = time.process_time()
    metrics, _ = run_inprocess(llm, requests, concurrency, **options)
    return metrics, time.process_time() - cpu


def alternating(round_index: int, arms: tuple[str, str]) -> tuple[str, str]:
    return arms if round_index % 2 == 0 else arms[::-1]


def main() -> None:
    from conveyor.engine import StructuredOutputsParams
    from conveyor.engine.structured.grammar_compiler import GrammarCompiler

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the figures as a Markdown section "
                        "(docs/img/structured_outputs.md: bench/run_suite.py --report-only "
                        "keeps it in docs/benchmarks.md)")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    llm = make_llm(max_model_len=1024)
    person = StructuredOutputsParams(json=json.dumps(PERSON))
    requests = person_requests(llm, args.num_requests, args.max_tokens)
    _, warm = run_inprocess(llm, requests, args.concurrency, ignore_eos=False,
                            structured_outputs=person)
    mean_len = round(statistics.mean(r.output_tokens for r in warm))
    free = [BenchRequest(r.prompt, r.prompt_len, mean_len) for r in requests]
    run_inprocess(llm, free, args.concurrency)  # warm-up
    arms = {"constrained": dict(requests=requests, ignore_eos=False, structured_outputs=person),
            "unconstrained": dict(requests=free, ignore_eos=True)}
    tok_s, cpu_ms_per_token, itl = {a: [] for a in arms}, {a: [] for a in arms}, {}
    num_compiled = 0

    def grammar_compiler():
        return GrammarCompiler(llm.core.grammars.tokenizer, 1, 4)

    for round_index in range(args.rounds):
        for arm in alternating(round_index, tuple(arms)):
            options = dict(arms[arm])
            metrics, cpu_s = timed_run(llm, options.pop("requests"), args.concurrency, **options)
            tok_s[arm].append(metrics.output_throughput)
            cpu_ms_per_token[arm].append(cpu_s * 1e3 / metrics.total_output_tokens)
        order = ("compiling", "quiet", "busy core")
        for arm in order[round_index % 3:] + order[:round_index % 3]:
            if arm == "compiling":
                with CompileLoad(grammar_compiler, StructuredOutputsParams) as load:
                    metrics, _ = run_inprocess(llm, free, args.concurrency)
                num_compiled += load.num_compiled
            elif arm == "busy core":
                with BusyLoad():
                    metrics, _ = run_inprocess(llm, free, args.concurrency)
            else:
                metrics, _ = run_inprocess(llm, free, args.concurrency)
            itl.setdefault(arm, []).append((metrics.itl.p50, metrics.itl.p99))
    figures = report(args, mean_len, tok_s, cpu_ms_per_token, itl, num_compiled,
                     compile_times(llm.core.grammars, StructuredOutputsParams, args.rounds * 3))
    figures["load_average"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    figures["dtype"] = str(llm.core.runner.config.torch_dtype).removeprefix("torch.")
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(markdown(figures, " ".join(sys.argv[1:])))


def markdown(figures: dict, arguments: str) -> str:
    """The figures as docs/benchmarks.md's structured-outputs section."""
    tok_s, cpu, itl = (figures["output_tok_s"], figures["cpu_ms_per_output_token"],
                       figures["itl_ms_p50_p99"])
    ratios = figures["itl_p99_ratio_per_round"]
    compile_ms = figures["person_schema_compile"]
    return "\n".join([
        "## Structured outputs (issue 29)", "",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python -m bench structured-outputs {arguments}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, in process (the bundled model, "
        f"{figures['dtype']} (the engine's dtype auto on this CPU), the engine's default torch "
        f"threads), c{figures['concurrency']}, "
        f"{figures['num_requests']} requests an arm, {figures['rounds']} rounds with the arms "
        f"alternating; load average {figures['load_average'][0]} -> "
        f"{figures['load_average'][1]} on the shared 2-CPU machine.", "",
        "| measure | constrained / compiling | unconstrained / quiet | ratio | target |",
        "|---|---|---|---|---|",
        f"| c16 output tok/s, JSON schema on every request | {tok_s['constrained']} | "
        f"{tok_s['unconstrained']} | {figures['tok_s_ratio_per_round']} (median of rounds) "
        "| >= 0.9 |",
        f"| CPU ms per output token | {cpu['constrained']} | {cpu['unconstrained']} | "
        f"{round(cpu['constrained'] / cpu['unconstrained'], 3)} | |",
        f"| ITL p50 / p99 ms, unconstrained, slow grammars compiling back to back | "
        f"{itl['compiling'][0]} / {itl['compiling'][1]} | {itl['quiet'][0]} / {itl['quiet'][1]} "
        f"| p99 {ratios['compiling']} | p99 <= 1.1 |",
        f"| the same with a core kept busy instead (control) | {itl['busy core'][0]} / "
        f"{itl['busy core'][1]} | | p99 {ratios['busy core']} | |",
        f"| compiling against the control (what compiling adds to any busy second core) | "
        f"{itl['compiling'][1]} | {itl['busy core'][1]} | p99 "
        f"{round(itl['compiling'][1] / itl['busy core'][1], 3)} | p99 <= 1.1 (proposed) |",
        f"| compile of the schema, cold / cached | {compile_ms['cold_ms']} ms / "
        f"{compile_ms['cached_ms']} ms | | | |", "",
        f"{figures['slow_grammars_compiled_meanwhile']} slow grammars (~0.1 s each alone) compiled "
        f"during the compiling arms; mean constrained output {figures['mean_output_tokens']} "
        "tokens (the unconstrained arm generates as many, ignore_eos).", ""])


def report(args, mean_len, tok_s, cpu_ms_per_token, itl, num_compiled, compile_ms) -> dict:
    """Medians over the rounds, and the median of each round's constrained / unconstrained
    and compiling / quiet ratio (the two arms of a round ran back to back)."""
    def median_ratio(pairs_a, pairs_b):
        return round(statistics.median(a / b for a, b in zip(pairs_a, pairs_b, strict=True)), 3)

    return {
        "concurrency": args.concurrency, "num_requests": args.num_requests,
        "rounds": args.rounds, "mean_output_tokens": mean_len,
        "output_tok_s": {a: round(statistics.median(v), 1) for a, v in tok_s.items()},
        "tok_s_ratio_per_round": median_ratio(tok_s["constrained"], tok_s["unconstrained"]),
        "cpu_ms_per_output_token": {a: round(statistics.median(v), 2)
                                    for a, v in cpu_ms_per_token.items()},
        "person_schema_compile": compile_ms,
        "itl_ms_p50_p99": {a: [round(statistics.median(p[i] for p in v), 2) for i in (0, 1)]
                           for a, v in itl.items()},
        "itl_p99_ratio_per_round": {
            a: median_ratio([p[1] for p in itl[a]], [p[1] for p in itl["quiet"]])
            for a in ("compiling", "busy core")},
        "slow_grammars_compiled_meanwhile": num_compiled,
    }


if __name__ == "__main__":
    main()
