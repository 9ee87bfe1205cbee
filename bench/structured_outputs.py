"""Structured outputs in process (issue 29): what a JSON-schema constraint on every request
costs, what compiling costs, and whether compiling disturbs the streams that do not wait for it.

One offline LLM (the bundled model), c16, four arms in rotating order over --rounds:
"constrained", every request under a typical JSON schema (a pydantic-style person: nested
object, enum, array, number); "unconstrained", the same requests with ignore_eos and as many
output tokens as the constrained arm's mean; "compiling", the same while slow grammars (a
2,000-field schema, ~0.1 s each, a new text each time) compile back to back on a compiler
thread; "busy core", the same while a thread at that priority only keeps a core busy (the
control: what any second busy core costs the step loop). Figures: output tok/s and CPU per
token of the first two, inter-token latency p50 / p99 of the last three, and the schema's
compile time cold (a new text each time) and cached.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench structured-outputs [--concurrency 16] \\
        [--num-requests 32] [--max-tokens 96] [--rounds 5] [--out docs/img/structured_outputs.md]
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import statistics
import threading
import time

from bench import arms
from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import BenchRequest

PERSON = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "height_m", "city", "hobbies", "address"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "height_m": {"type": "number"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Berlin"]},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["street", "number"],
                    "properties": {"street": {"type": "string"}, "number": {"type": "integer"}}}}}
NAMES = ["Ada", "Boris", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ines", "Jonas",
         "Kenji", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
ARMS = ("constrained", "unconstrained", "compiling", "busy core")


def slow_schema(tag: int) -> dict:
    """A schema that takes ~0.1 s to compile (2,000 fields, each a pattern), titled `tag`."""
    return {"title": f"slow {tag}", "type": "object", "required": ["f0"], "properties": {
        f"f{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 20}}}x{i}"}
        for i in range(2000)}}


def compile_times(compiler, structured_outputs_params, rounds: int) -> dict:
    """Median ms of compiling PERSON with a fresh title (cold), then again (cached)."""
    def compile_ms(params) -> float:
        start = time.perf_counter()
        compiler.compile(params).result()
        return (time.perf_counter() - start) * 1e3

    now = time.time_ns()
    titled = [structured_outputs_params(json=json.dumps({**PERSON, "title": f"person {now} {i}"}))
              for i in range(rounds)]
    cold, cached = zip(*[(compile_ms(params), compile_ms(params)) for params in titled],
                       strict=True)
    return {"cold_ms": round(statistics.median(cold), 2),
            "cached_ms": round(statistics.median(cached), 4)}


class Repeating(threading.Thread):
    """Calls `work()` back to back on this thread (`on_start()` first) while the `with` block
    runs; `count`: the calls it finished."""

    def __init__(self, work, on_start=lambda: None) -> None:
        super().__init__(daemon=True)
        self.work, self.on_start, self.count = work, on_start, 0
        self.stopping = threading.Event()

    def run(self) -> None:
        self.on_start()
        while not self.stopping.is_set():
            self.work()
            self.count += 1

    def __enter__(self) -> Repeating:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.join()


def compile_load(compiler, structured_outputs_params) -> Repeating:
    """Slow grammars compiled back to back on `compiler` (not the engine's: the engine loop
    never waits for them), the same schema with a new text each time."""
    text = json.dumps(slow_schema(time.time_ns()))
    spaces = itertools.count()
    return Repeating(lambda: compiler.compile(
        structured_outputs_params(json=text + " " * next(spaces))).result())


def busy_core() -> Repeating:
    """The control for compile_load: a thread at the compile threads' priority that only
    keeps one core busy (sha256 over 16 MB, the GIL released), no grammar involved: what any
    second busy core costs the step loop on this machine."""
    from conveyor.engine.structured.grammar_compiler import lower_thread_priority

    data = bytes(16 << 20)
    return Repeating(lambda: hashlib.sha256(data).digest(), lower_thread_priority)


def main() -> None:
    from conveyor.engine import StructuredOutputsParams
    from conveyor.engine.structured.grammar_compiler import GrammarCompiler

    parser = arms.parser(__doc__, rounds=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    header = arms.Header("structured-outputs")
    llm = make_llm(max_model_len=1024)
    person = StructuredOutputsParams(json=json.dumps(PERSON))
    questions = [f"Describe {NAMES[i % len(NAMES)]} (person {i}), a fictional person, as JSON."
                 for i in range(args.num_requests)]
    requests = arms.chat_requests(llm, questions, args.max_tokens)
    _, outputs = run_inprocess(llm, requests, args.concurrency, ignore_eos=False,
                               structured_outputs=person)
    mean_len = round(statistics.mean(r.output_tokens for r in outputs))
    free = [BenchRequest(r.prompt, r.prompt_len, mean_len) for r in requests]
    compiler = GrammarCompiler(llm.core.grammars.tokenizer, 1, 4)
    loads = {"compiling": lambda: compile_load(compiler, StructuredOutputsParams),
             "busy core": busy_core}

    def measure(arm: str) -> arms.Sample:
        options = (dict(requests=requests, ignore_eos=False, structured_outputs=person)
                   if arm == "constrained" else dict(requests=free))
        with loads.get(arm, contextlib.nullcontext)() as load:
            cpu = time.process_time()  # less sensitive than wall time to other processes
            metrics, _ = run_inprocess(llm, concurrency=args.concurrency, **options)
            cpu_ms = (time.process_time() - cpu) * 1e3
        return {"tok_s": metrics.output_throughput, "itl_p50": metrics.itl.p50,
                "itl_p99": metrics.itl.p99, "compiled": load.count if load else 0,
                "cpu_ms_per_token": cpu_ms / metrics.total_output_tokens}

    rounds = arms.run_rounds(ARMS, args.rounds, measure)
    compiler.close()
    arms.publish({
        **header.figures(llm), "concurrency": args.concurrency,
        "num_requests": args.num_requests, "rounds": args.rounds, "mean_output_tokens": mean_len,
        "person_schema_compile": compile_times(llm.core.grammars, StructuredOutputsParams,
                                               args.rounds * 3),
        "slow_grammars_compiled_meanwhile": rounds.total("compiling", "compiled"),
        "itl_p99_compiling_vs_busy_core": rounds.ratio("compiling", "busy core", "itl_p99"),
        "arms": rounds.summary("unconstrained", "tok_s", "cpu_ms_per_token", "itl_p50",
                               "itl_p99")}, args.out, markdown)


def markdown(figures: dict) -> str:
    """The figures as docs/benchmarks.md's structured-outputs section."""
    constrained, free, compiling, busy = (figures["arms"][arm] for arm in ARMS)
    compile_ms = figures["person_schema_compile"]

    def itl(f):
        return f"{f['itl_p50']} / {f['itl_p99']}"

    return arms.section(
        "## Structured outputs (issue 29)", figures,
        f"c{figures['concurrency']}, {figures['num_requests']} requests an arm; arms: the JSON "
        "schema on every request, none, none with slow grammars compiling, none with a core "
        "kept busy", ["measure", "constrained / compiling", "unconstrained / quiet", "ratio",
                      "target"], [
            [f"c{figures['concurrency']} output tok/s, JSON schema on every request",
             constrained["tok_s"], free["tok_s"], constrained["tok_s_ratio"], ">= 0.9"],
            ["CPU ms per output token", constrained["cpu_ms_per_token"],
             free["cpu_ms_per_token"], constrained["cpu_ms_per_token_ratio"], ""],
            ["ITL p50 / p99 ms, unconstrained, slow grammars compiling back to back",
             itl(compiling), itl(free), f"p99 {compiling['itl_p99_ratio']}", "p99 <= 1.1"],
            ["the same with a core kept busy instead (control)", itl(busy), "",
             f"p99 {busy['itl_p99_ratio']}", ""],
            ["compiling against the control (what compiling adds to any busy second core)",
             compiling["itl_p99"], busy["itl_p99"],
             f"p99 {figures['itl_p99_compiling_vs_busy_core']}", "p99 <= 1.1 (proposed)"],
            ["compile of the schema, cold / cached",
             f"{compile_ms['cold_ms']} ms / {compile_ms['cached_ms']} ms", "", "", ""]],
        f"{figures['slow_grammars_compiled_meanwhile']} slow grammars (~0.1 s each alone) "
        f"compiled during the compiling arms; mean constrained output "
        f"{figures['mean_output_tokens']} tokens (the unconstrained arm generates as many, "
        "ignore_eos).")


if __name__ == "__main__":
    main()
