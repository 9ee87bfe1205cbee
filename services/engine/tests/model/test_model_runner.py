"""ModelRunner behaviour on the bundled model beyond greedy parity."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1789]


def test_only_sampling_requests_get_tokens(make_runner, make_driver):
    driver = make_driver(make_runner(), token_budget=6)
    driver.add("long", PROMPT * 2, 2)
    step = driver.schedule()
    assert not step.scheduled[0].needs_sample
    assert driver.runner.execute(step).sampled == {}
    assert driver.runner.execute(SchedulerOutput(block_size=16)).sampled == {}


def test_block_size_mismatch_is_refused(make_runner, make_driver):
    driver = make_driver(make_runner(), token_budget=8)
    driver.add("a", PROMPT, 1)
    step = driver.schedule()
    step.block_size = 32
    with pytest.raises(ValueError, match="block_size"):
        driver.runner.execute(step)


def test_token_budget_over_buffers_is_refused(make_runner, make_driver):
    driver = make_driver(make_runner(max_num_batched_tokens=4), token_budget=8)
    driver.add("a", PROMPT, 1)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4"):
        driver.runner.execute(driver.schedule())


def test_sequence_past_max_model_len_is_refused(make_runner, make_driver):
    driver = make_driver(make_runner(max_model_len=32, block_size=4), token_budget=64)
    driver.add("a", PROMPT * 5, 1)
    with pytest.raises(ValueError, match="max_model_len=32"):
        driver.runner.execute(driver.schedule())


def test_seeded_sampling_is_reproducible_through_the_runner(make_runner, make_driver):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=4)
    runs = []
    for budget, mates in ((64, 0), (6, 1)):
        driver = make_driver(make_runner(seed=budget), token_budget=budget)
        driver.add("seeded", PROMPT, 4, params)
        for i in range(mates):
            driver.add(f"mate{i}", PROMPT[::-1], 4, SamplingParams(temperature=1.0))
        runs.append(driver.run()["seeded"])
    assert runs[0] == runs[1]


def test_cpu_sizing_from_gib(smollm2_model):
    runner = ModelRunner(EngineConfig(model="(preloaded)", kv_cache_gib=0.05,
                                      max_model_len=512), model=smollm2_model)
    assert runner.capacity.num_blocks == int(0.05 * 2**30) // (45 * 1024 * 16)
    assert runner.kv_caches[0].shape == (2, runner.capacity.num_blocks, 16, 3, 64)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        ModelRunner(EngineConfig(model="(preloaded)", kv_cache_gib=0.001,
                                 max_model_len=8192), model=smollm2_model)


def test_fp16_kv_pool_holds_twice_the_blocks(smollm2_model):
    """kv_cache_dtype float16: the pool is fp16 and the same space holds twice the blocks."""
    sizes = {}
    for kv_dtype in ("auto", "float16"):
        runner = ModelRunner(EngineConfig(model="(preloaded)", kv_cache_gib=0.05,
                                          max_model_len=512, kv_cache_dtype=kv_dtype),
                             model=smollm2_model)
        sizes[kv_dtype] = runner.capacity.num_blocks
        assert runner.kv_caches[0].dtype == (torch.float16 if kv_dtype == "float16"
                                             else torch.float32)
    assert sizes["float16"] == int(0.05 * 2**30) // (45 * 512 * 16) > sizes["auto"] * 1.99


def test_kv_cache_dtype_refusals():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not one of"):
        EngineConfig(model="x", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="CPU option.*change kv_cache_dtype to auto"):
        EngineConfig(model="x", device="cuda", dtype="bfloat16",
                     kv_cache_dtype="float16")
    from conveyor.engine.engine_factory import _in_setting_names
    from conveyor.engine.settings import EngineSettings

    with pytest.raises(ValueError, match="change CONVEYOR_ENGINE_KV_CACHE_DTYPE"):
        EngineSettings(kv_cache_dtype="fp8").resolved_kv_cache_dtype()
    assert "change CONVEYOR_ENGINE_KV_CACHE_DTYPE to auto" in _in_setting_names(
        "... change kv_cache_dtype to auto")


def test_bf16_on_cpu_tracks_fp32(smollm2_folder, make_runner, make_driver):
    from conveyor.engine.model.loader import load_model

    bf16 = ModelRunner(EngineConfig(model="(preloaded)", dtype="bfloat16", num_blocks=32,
                                    max_model_len=256, max_num_batched_tokens=64),
                       model=load_model(smollm2_folder, dtype=torch.bfloat16))
    assert bf16.kv_caches[0].dtype == torch.bfloat16
    logits = []
    for runner in (bf16, make_runner()):
        driver = make_driver(runner, token_budget=64)
        driver.add("a", PROMPT, 1)
        logits.append(runner.compute_logits(driver.schedule())[0])
    cosine = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0)
    assert cosine > 0.99
    assert logits[0].argmax() == logits[1].argmax()


def test_gpu_dtypes_refused_on_cpu():
    with pytest.raises(ValueError, match="float16"):
        EngineConfig(model="x", dtype="float16")


def test_converted_gguf_folder_is_plain_hf(smollm2_folder):
    import json

    from safetensors import safe_open

    from conveyor.engine.model.gguf_convert import is_converted
    from conveyor.engine.model.loader import resolve_checkpoint

    assert is_converted(smollm2_folder)
    assert resolve_checkpoint(str(smollm2_folder)) == smollm2_folder
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    with safe_open(str(smollm2_folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert (smollm2_folder / "tokenizer_config.json").is_file()


def test_prompt_logprobs_match_the_logits_of_each_prefix(make_runner, make_driver):
    """Over a prefill in chunks of 3, each prompt token's logprob, rank and top-2 equal
    those read off the last-position logits of the prompt cut just before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    driver = make_driver(make_runner(), token_budget=3)
    driver.runner = recording = _Recording(driver.runner)
    driver.add("p", PROMPT, 1, params)
    driver.run()
    found = [entry for output in recording.outputs
             for entry in output.prompt_logprobs.get("p", [])]
    assert len(found) == len(PROMPT) - 1 and len(recording.outputs) == 3
    reference_runner = make_runner()
    for position, entry in enumerate(found, start=1):
        reference = make_driver(reference_runner, token_budget=64)
        reference.add("r", PROMPT[:position], 1)
        logprobs = reference_runner.compute_logits(reference.schedule())[0].log_softmax(-1)
        target = logprobs[PROMPT[position]]
        assert entry.logprob == pytest.approx(target.item(), abs=1e-4)
        assert entry.rank == int((logprobs > target).sum()) + 1
        values, ids = logprobs.topk(2)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


class _Recording:
    """A runner that keeps every step's output."""

    def __init__(self, runner):
        self.runner, self.outputs = runner, []

    def execute(self, step):
        self.outputs.append(self.runner.execute(step))
        return self.outputs[-1]


def test_the_profiling_step_runs_before_the_pool_and_the_drafter_exist(smollm2_model,
                                                                       monkeypatch):
    """On a GPU the pool is sized by running the largest step on a scratch pool first
    (the engine's default there): that step runs on a runner with no pool and no drafter
    yet. Here on the CPU with torch.cuda's memory counters faked: 8 GiB, 90% usable, a
    1 GiB peak."""
    gib = 2**30
    fakes = {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda _d: None,
             "synchronize": lambda _d: None, "max_memory_allocated": lambda _d: gib,
             "memory_reserved": lambda _d: 0, "mem_get_info": lambda _d: (8 * gib, 8 * gib)}
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(ModelRunner, "_num_blocks", ModelRunner._num_blocks_by_profiling)
    runner = ModelRunner(EngineConfig(model="(preloaded)", max_model_len=512,
                                      max_num_batched_tokens=64, max_num_seqs=4),
                         model=smollm2_model)
    assert runner.drafter is None
    assert runner.capacity.num_blocks == int(8 * gib * 0.9 - gib) // (45 * 1024 * 16)


def test_a_draft_models_pool_is_counted_in_the_kv_space(smollm2_model, monkeypatch):
    """speculative_method draft: the draft model's pool has as many blocks as the
    model's, so a block costs both pools' bytes and kv_cache_gib holds both."""
    monkeypatch.setattr("conveyor.engine.worker.model_runner.load_model",
                        lambda *_a, **_k: smollm2_model)
    runner = ModelRunner(EngineConfig(model="(preloaded)", kv_cache_gib=0.05,
                                      max_model_len=512, draft_model="(preloaded)"),
                         model=smollm2_model)
    assert runner.capacity.num_blocks == int(0.05 * 2**30) // (2 * 45 * 1024 * 16)
    assert runner.drafter is not None
