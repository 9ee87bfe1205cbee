"""LoRA adapters in the offline engine: greedy output with an adapter equals transformers +
peft with the adapter merged, token for token, in fp32; one step mixing the base model and
two adapters gives each row what it gets alone; an adapter's prefix-cache blocks serve no
other adapter; more adapters than max_loras wait their turn; bad adapters are refused."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from conveyor.engine import LLM, LoRARequest, SamplingParams
from conveyor.engine.lora.adapter import InvalidAdapter

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Three primary colors are red,"]


@pytest.fixture(scope="module")
def adapters(make_lora_adapter):
    return {"r8": make_lora_adapter.make(8, seed=1), "r16": make_lora_adapter.make(16, seed=2),
            "attn-only": make_lora_adapter.make(8, seed=3, targets=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def llm(engine_test_support):
    llm = LLM(engine_test_support.model, dtype="float32", max_model_len=1024, kv_cache_gib=0.25,
              torch_threads=engine_test_support.torch_threads, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(make_lora_adapter, adapters, prompts):
    """adapter name -> transformers' greedy tokens per prompt, the adapter merged."""
    greedy = {}
    for name, folder in adapters.items():
        model = make_lora_adapter.reference(folder)
        with torch.inference_mode():
            greedy[name] = [_hf_greedy(model, prompt) for prompt in prompts]
        del model
    return greedy


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return out[0, len(prompt):].tolist()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["r8", "r16", "attn-only"])
def test_greedy_output_equals_peft_merged(llm, adapters, prompts, reference, name):
    for prompt, expected in zip(prompts, reference[name], strict=True):
        [output] = llm.generate([prompt], _greedy(),
                                lora_request=LoRARequest(name, 1, adapters[name]))
        assert output.outputs[0].token_ids == expected


def test_one_step_mixes_the_base_model_and_two_adapters(llm, adapters, prompts, reference):
    alone_base = _tokens(llm.generate(prompts, _greedy()))
    names = [None, "r8", "r16"]
    items, wanted = [], []
    for prompt in prompts:
        for name in names:
            items.append(prompt)
            wanted.append(None if name is None else LoRARequest(name, 1, adapters[name]))
    mixed = _tokens(llm.generate(items, _greedy(), lora_request=wanted))
    for i, (tokens, request) in enumerate(zip(mixed, wanted, strict=True)):
        prompt_index = i // len(names)
        expected = (alone_base[prompt_index] if request is None
                    else reference[request.lora_name][prompt_index])
        assert tokens == expected, (i, request)
    assert reference["r8"] != alone_base and reference["r16"] != alone_base


def _hit_tokens(llm) -> int:
    return llm.core.stats().prefix_cache_hits


def test_an_adapters_cached_blocks_serve_no_other(llm, adapters, engine_test_support):
    prompt = engine_test_support.cases[0].token_ids * 3  # a few full blocks
    one, two = LoRARequest("r8", 1, adapters["r8"]), LoRARequest("r16", 2, adapters["r16"])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], params, lora_request=one)
    before = _hit_tokens(llm)
    llm.generate([prompt], params, lora_request=two)
    llm.generate([prompt], params)  # the base model
    assert _hit_tokens(llm) == before
    llm.generate([prompt], params, lora_request=one)
    assert _hit_tokens(llm) - before >= len(prompt) // 16 * 16 - 16


def test_more_adapters_than_max_loras_take_turns(llm, adapters, prompts, reference):
    names = ["r8", "r16", "attn-only"] * 2  # three adapters, two slots
    outputs = llm.generate([prompts[0]] * len(names), _greedy(),
                           lora_request=[LoRARequest(n, 1, adapters[n]) for n in names])
    assert _tokens(outputs) == [reference[n][0] for n in names]


def test_bad_adapters_are_refused_saying_why(llm, make_lora_adapter, tmp_path, adapters):
    params = SamplingParams(max_tokens=1)
    with pytest.raises(InvalidAdapter, match="rank 32"):
        llm.generate(["x"], params,
                     lora_request=LoRARequest("big", 1, make_lora_adapter.make(32, 4)))
    with pytest.raises(InvalidAdapter, match="cannot read"):
        llm.generate(["x"], params, lora_request=LoRARequest("gone", 1, str(tmp_path / "nothing")))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(adapters["r8"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (Path(adapters["r8"]) / "adapter_model.safetensors").read_bytes())
    with pytest.raises(InvalidAdapter, match="use_dora"):
        llm.generate(["x"], params, lora_request=LoRARequest("dora", 1, str(dora)))
    stats = llm.core.stats()
    assert not llm.core.has_unfinished_requests and stats.num_free_blocks == stats.num_blocks
