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
  vs without.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.structured_outputs [--concurrency 16] \\
        [--num-requests 32] [--max-tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

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


def main() -> None:
    from conveyor.engine import StructuredOutputsParams
    from conveyor.engine.structured.grammar_compiler import GrammarCompiler

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = make_llm(max_model_len=1024)
    person = StructuredOutputsParams(json=json.dumps(PERSON))
    requests = person_requests(llm, args.num_requests, args.max_tokens)
    _, warm = run_inprocess(llm, requests, args.concurrency, ignore_eos=False,
                            structured_outputs=person)
    mean_len = round(statistics.mean(r.output_tokens for r in warm))
    free = [BenchRequest(r.prompt, r.prompt_len, mean_len) for r in requests]
    run_inprocess(llm, free, args.concurrency)  # warm-up
    tok_s = {"constrained": [], "unconstrained": []}
    itl = {"compiling": [], "quiet": []}
    num_compiled = 0

    def grammar_compiler():
        return GrammarCompiler(llm.core.grammars.tokenizer, 1, 4)

    for round_index in range(args.rounds):
        for arm in (("constrained", "unconstrained") if round_index % 2 == 0
                    else ("unconstrained", "constrained")):
            metrics, _ = run_inprocess(
                llm, requests if arm == "constrained" else free, args.concurrency,
                ignore_eos=arm == "unconstrained",
                structured_outputs=person if arm == "constrained" else None)
            tok_s[arm].append(metrics.output_throughput)
        for arm in (("compiling", "quiet") if round_index % 2 == 0 else ("quiet", "compiling")):
            if arm == "compiling":
                with CompileLoad(grammar_compiler, StructuredOutputsParams) as load:
                    metrics, _ = run_inprocess(llm, free, args.concurrency)
                num_compiled += load.num_compiled
            else:
                metrics, _ = run_inprocess(llm, free, args.concurrency)
            itl[arm].append((metrics.itl.p50, metrics.itl.p99))
    medians = {arm: statistics.median(values) for arm, values in tok_s.items()}
    report = {
        "concurrency": args.concurrency, "num_requests": args.num_requests,
        "rounds": args.rounds, "mean_output_tokens": mean_len,
        "output_tok_s": {arm: round(v, 1) for arm, v in medians.items()},
        "constrained_over_unconstrained": round(medians["constrained"]
                                                / medians["unconstrained"], 3),
        "person_schema_compile": compile_times(llm.core.grammars, StructuredOutputsParams,
                                               args.rounds * 3),
        "itl_ms_p50_p99": {arm: [round(statistics.median(p[i] for p in values), 2)
                                 for i in (0, 1)] for arm, values in itl.items()},
        "slow_grammars_compiled_meanwhile": num_compiled,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
