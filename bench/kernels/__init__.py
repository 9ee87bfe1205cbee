"""`python -m bench kernel KERNEL [options]`: kernels alone, a subcommand per kernel family
(linear, decode-attention, prefill-attention, roofline, fma). Each takes --threads (torch's
threads, default 2) and prints the machine, then a Markdown table.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.harness import machine_line


def _parser() -> argparse.ArgumentParser:
    from bench.kernels import decode_attention, fma_peak, linear, prefill_attention, roofline

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    kernels = parser.add_subparsers(dest="kernel", required=True)
    for name, module in {"linear": linear, "decode-attention": decode_attention,
                         "prefill-attention": prefill_attention, "roofline": roofline,
                         "fma": fma_peak}.items():
        sub = kernels.add_parser(name, parents=[common], help=module.__doc__.splitlines()[0],
                                 description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line())
    args.run(args)
    return 0
