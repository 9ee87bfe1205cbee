"""Compiling constraints into grammars on a small thread pool, cached by (kind, text)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.grammar_matcher import GrammarMatcher
from conveyor.engine.structured.llguidance_grammar import llguidance_grammar
from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams

log = logging.getLogger("conveyor.engine.structured")

COMPILE_THREAD_NICENESS = 10
"""How much lower than the engine's threads the compile threads run (Linux: per thread).
Where cores are short, a compile takes the CPU the step loop and torch leave over, rather
than stretching every step: on the 2-core machine, back-to-back compiles of a 0.1 s schema
put c16 inter-token latency p99 up 2.9x at the same priority (docs/benchmarks.md)."""


class CompiledGrammar:
    """A grammar built for the model's tokenizer: a matcher at the start of the output,
    copied (a few microseconds) for each sample that uses it. Never advanced itself."""

    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints off the step loop and keeps the latest `cache_size` of them.

    `compile` returns at once a Future of the CompiledGrammar, which raises
    InvalidConstraint with the library's message for a constraint that does not compile.
    Requests with the same (kind, text) share one future while it is cached (failures
    included: the same bad schema gets the same answer without compiling again). Only
    the engine loop thread calls `compile`; the pool's threads only build grammars (the
    library drops the GIL while it does, so a long compile does not stall the loop).
    A compile nobody waits for any more runs to its end and stays cached.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, num_threads: int,
                 cache_size: int) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile",
                                        initializer=lower_thread_priority)

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = params.key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._submit(params)
        self._cache[key] = future
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        """Drop queued compiles; one already running finishes in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The grammar's definition is made here, on the caller's thread (12 us for a
        typical schema, ~1 ms for 2,000 fields): the library holds the GIL while it makes
        it, and a compile thread, at its lower priority, could hold the GIL for much longer
        than that when other work keeps it off the CPU, stalling the loop (ITL p99 1.42x
        with it on the pool, docs/benchmarks.md). Only the build, which drops the GIL,
        goes to the pool."""
        try:
            grammar = llguidance_grammar(params)
        except InvalidConstraint as exc:
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(exc)
            return failed
        return self._pool.submit(self._build, params.kind, grammar)

    def _build(self, kind: str, grammar: str) -> CompiledGrammar:
        start = time.perf_counter()
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidConstraint(f"structured output {kind} does not compile: "
                                    f"{template.get_error()}")
        log.debug("compiled a %s grammar in %.1f ms", kind, (time.perf_counter() - start) * 1e3)
        return CompiledGrammar(template)


def lower_thread_priority() -> None:
    """Run the calling thread (a compile thread, as it starts) COMPILE_THREAD_NICENESS
    below the rest of the engine. Linux only: elsewhere setpriority would lower the whole
    process."""
    if sys.platform != "linux":
        return
    thread_id = threading.get_native_id()
    niceness = os.getpriority(os.PRIO_PROCESS, thread_id) + COMPILE_THREAD_NICENESS
    os.setpriority(os.PRIO_PROCESS, thread_id, min(19, niceness))  # lowering never needs rights


def grammar_tokenizer(hf_tokenizer, vocab_size: int,
                      eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The library's view of the model's (fast) HF tokenizer: `vocab_size` mask bits (the
    model's vocabulary, which may exceed the tokenizer's), and EOS the model's EOS ids,
    which a mask allows once the output is a whole match. Takes ~0.2 s: built once."""
    backend = hf_tokenizer.backend_tokenizer
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids))
