"""Multi-LoRA throughput in process (issue 34): the base model alone vs 4 adapters mixed.

One offline LLM (the bundled model, the engine's default dtype, enable_lora with
max_loras 4) runs c16 random prompts (256 tokens in, 128 out, ignore_eos) in three arms,
in rotating order over --rounds after a warm-up round: every request on the base model;
every request on one adapter; requests spread round-robin over four adapters (each step
mixes them). The adapters are made here with peft (seeded random A and B on all seven
projections, rank --rank). Target: 4 adapters mixed >= 0.8x the base model's tok/s.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench lora [--rounds 3] [--rank 16] [--threads N] \\
        [--out docs/img/lora.md]
"""

from __future__ import annotations

import tempfile

from bench import arms
from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import load_prompt_maker

MODEL = "smollm2-135m-instruct"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARMS = ("base", "1 adapter", "4 adapters")


def make_adapter(folder: str, rank: int, seed: int,
                 targets: tuple[str, ...] = PROJECTIONS) -> str:
    """A PEFT LoRA adapter of the bundled model in `folder`, made with peft itself: seeded
    random, non-zero A and B (init_lora_weights=False), lora_alpha 2 x rank."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from conveyor.engine.model.loader import resolve_checkpoint

    base = LlamaForCausalLM.from_pretrained(resolve_checkpoint(MODEL), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return folder


def main() -> None:
    parser = arms.parser(__doc__, rounds=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's)")
    args = parser.parse_args()
    header = arms.Header("lora")
    threads = {"torch_threads": args.threads} if args.threads else {}
    llm = make_llm(max_model_len=1024, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                   **threads)
    with tempfile.TemporaryDirectory() as scratch:
        adapters = [llm.core.loras.load(f"a{i}", make_adapter(f"{scratch}/a{i}", args.rank, i))
                    for i in range(4)]
    loras = {"base": [None], "1 adapter": adapters[:1], "4 adapters": adapters}
    requests = load_prompt_maker().random_requests(2 * args.concurrency, 256, 128, as_ids=True)

    def measure(arm: str) -> arms.Sample:
        metrics, _ = run_inprocess(llm, requests, args.concurrency, loras=loras[arm])
        return {"tok_s": metrics.output_throughput, "tpot_ms": metrics.tpot.mean}

    rounds = arms.run_rounds(ARMS, args.rounds, measure)
    arms.publish({**header.figures(llm), "concurrency": args.concurrency, "rank": args.rank,
                  "rounds": args.rounds, "arms": rounds.summary("base", "tok_s", "tpot_ms")},
                 args.out, markdown)


def markdown(figures: dict) -> str:
    """The figures as docs/benchmarks.md's LoRA section."""
    return arms.section(
        "## Multi-LoRA (issue 34)", figures,
        f"c{figures['concurrency']} random prompts, 256 tokens in and 128 out, adapters of rank "
        f"{figures['rank']} on all seven projections, max_loras 4",
        ["requests on", "output tok/s", "TPOT ms", "vs base", "target"],
        [[arm, f["tok_s"], f["tpot_ms"], f"{f['tok_s_ratio']}x",
          ">= 0.8x" if arm == "4 adapters" else "report"] for arm, f in figures["arms"].items()])


if __name__ == "__main__":
    main()
