"""The `native` backend (C++ decode and prefill kernels over the paged pool) against the
torch one, on each of the decode kernel's code paths (AVX2; the AVX-512 shared-block
cascade, skipped where the CPU lacks AVX-512) and with prefill chunks through the prefill
kernel or torch.

The kernel is built once into the user's cache (CONVEYOR_NATIVE_DIR) by the first test
that needs it (~30 s, then imported in well under a second). Skipped, not failed, only
where this machine cannot build it at all: no C++ compiler or a CPU without AVX2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conveyor.engine.attention import create_backend
from conveyor.engine.attention.native_backend import NativeAttentionBackend
from conveyor.engine.attention.torch_backend import store_kv
from conveyor.engine.native import NativeBuildError, load_extension

TOLERANCE = 1e-4
"""Max absolute difference from the torch backend in fp32 (the brief's bound)."""

needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="no C++ compiler or no AVX2 on this machine: the native kernel cannot build")


PATHS = ("avx2", "avx512-cascade", "avx512")
"""The kernel paths every native test runs on (native_kernel.KERNEL_PATHS but auto): the
decode kernel's, each with the prefill kernel on the same instruction set (PREFILL_OF)."""
PREFILL_OF = {"avx2": "native-avx2", "avx512-cascade": "native-avx512", "avx512": "native-avx512"}


def native_backend(spec, path: str) -> NativeAttentionBackend:
    """The native backend forced onto `path` (decode) and PREFILL_OF[path] (prefill); skips
    the test where the CPU cannot run it."""
    backend = NativeAttentionBackend(spec)
    if path.startswith("avx512") and not backend._kernel.has_avx512():
        pytest.skip("this CPU lacks AVX-512: only the AVX2 path runs here")
    return NativeAttentionBackend(spec, path, prefill_path=PREFILL_OF[path])


def attend(step, path: str | None = None) -> torch.Tensor:
    """The step through the torch backend (path None) or the native one on `path`."""
    backend = create_backend("torch", step.spec) if path is None else native_backend(step.spec,
                                                                                       path)
    cache = step.kv_cache.clone()
    return backend.forward(step.query, step.key, step.value, cache, backend.plan(step.meta))


def assert_matches_torch(step, path: str) -> None:
    """fp32 rows: within TOLERANCE of the torch backend. bf16 rows (a bf16 model): the new keys
    and values stored as torch stores them, bit for bit, and the output within bf16 rounding
    (half an ulp: 2^-8 relative) of the torch backend computing in fp32 over the same pool."""
    if step.query.dtype != torch.bfloat16:
        diff = (attend(step, path) - attend(step)).abs().max().item()
        assert diff <= TOLERANCE, diff
        return
    native, reference = native_backend(step.spec, path), create_backend("torch", step.spec)
    pool, expected_pool = step.kv_cache.clone(), step.kv_cache.clone()
    out = native.forward(step.query, step.key, step.value, pool, native.plan(step.meta))
    store_kv(step.key, step.value, expected_pool, step.meta.slot_mapping)
    assert torch.equal(pool.view(torch.int16), expected_pool.view(torch.int16))
    expected = reference.attend(step.query.float(), pool.float(), reference.plan(step.meta))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=TOLERANCE)


POOL_DTYPES = ((torch.float32, torch.float32), (torch.float32, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16))
"""(model dtype, pool dtype) pairs the kernels read: fp32 rows over an fp32 pool, or an fp16
one (kv_cache_dtype float16); bf16 rows (a bf16 model) over a bf16 pool or an fp16 one. Over
an fp16 pool torch reads the same rounded keys and values (widened after its gather), so the
bound against it stays TOLERANCE."""
POOL_IDS = ("fp32", "fp32-kv16", "bf16", "bf16-kv16")


STEPS = {
    "decode-odd-lengths": [(0, 1), (9, 1), (30, 1), (47, 1), (100, 1), (15, 1), (16, 1)],
    "mixed-prefill-and-decode": [(0, 11), (9, 1), (30, 5), (1, 1), (47, 1)],
    "prefill-only": [(0, 7), (3, 9)],
    "one-request": [(300, 1)],
    "long-chunks-over-context": [(0, 50), (100, 37), (3, 1), (17, 64), (250, 2)],
}


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [None, 6, 40])
@pytest.mark.parametrize(("block_size", "group", "head_dim"),
                         [(16, 3, 64), (4, 1, 32), (8, 4, 128), (1, 3, 64), (5, 2, 64),
                          (16, 7, 64), (4, 6, 128)])
@pytest.mark.parametrize("seqs", STEPS.values(), ids=STEPS.keys())
def test_native_matches_torch(make_random_step, seqs, block_size, group, head_dim, window,
                              path):
    step = make_random_step(block_size=block_size, num_kv_heads=3, group=group,
                            head_dim=head_dim, seqs=seqs, sliding_window=window, seed=7)
    assert_matches_torch(step, path)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("block_size", "group", "head_dim"),
                         [(16, 3, 64), (4, 1, 32), (8, 4, 128), (5, 2, 64)])
@pytest.mark.parametrize("seqs", STEPS.values(), ids=STEPS.keys())
def test_fp16_pool_matches_torch(make_random_step, seqs, block_size, group, head_dim, window,
                                 path):
    """An fp16 pool (kv_cache_dtype float16): the new keys and values stored rounded exactly as
    torch rounds them, and attention over the rounded pool within TOLERANCE of torch's over
    the same pool; its distance from the fp32 pool's attention is the rounding's, small."""
    step = make_random_step(block_size=block_size, num_kv_heads=3, group=group,
                            head_dim=head_dim, seqs=seqs, sliding_window=window, seed=7,
                            kv_dtype=torch.float16)
    native, reference = native_backend(step.spec, path), create_backend("torch", step.spec)
    native_pool, torch_pool = step.kv_cache.clone(), step.kv_cache.clone()
    out = native.forward(step.query, step.key, step.value, native_pool, native.plan(step.meta))
    expected = reference.forward(step.query, step.key, step.value, torch_pool,
                                 reference.plan(step.meta))
    assert native_pool.dtype == torch.float16 and torch.equal(native_pool, torch_pool)
    assert (out - expected).abs().max().item() <= TOLERANCE
    wide = step.kv_cache.float()
    fp32 = reference.forward(step.query, step.key, step.value, wide, reference.plan(step.meta))
    assert (out - fp32).abs().max().item() <= 5e-3  # new rows rounded: randn's ~2^-11 relative


@needs_kernel
def test_fp16_store_rounds_as_torch_does(make_random_step):
    """The C++ store into an fp16 pool rounds to nearest even as torch's .to(float16) does, at
    the edges too: past 65504 to inf, below fp16's subnormals to zero, signs and NaN kept."""
    step = make_random_step(block_size=4, num_kv_heads=2, group=1, head_dim=32,
                            seqs=[(0, 6)], seed=1, kv_dtype=torch.float16)
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-10, -0.0,
                          float("nan"), float("inf"), 1 + 2 ** -11, 1 + 3 * 2 ** -11, 2.0 ** -24])
    key = torch.randn(6, 2, 32) * 100
    key.view(-1)[:edges.numel()] = edges
    value = -key
    native = NativeAttentionBackend(step.spec)
    pool, expected = step.kv_cache.clone(), step.kv_cache.clone()
    native._kernel.store_kv(pool, key, value, step.meta.slot_mapping)
    from conveyor.engine.attention.torch_backend import store_kv

    store_kv(key, value, expected, step.meta.slot_mapping)
    assert torch.equal(pool.view(torch.int16), expected.view(torch.int16))  # bit for bit
    with pytest.raises(RuntimeError, match="does not pair with"):
        native._kernel.store_kv(pool.to(torch.bfloat16), key, value, step.meta.slot_mapping)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "kv16"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("block_size", "group", "head_dim"),
                         [(16, 3, 64), (4, 1, 32), (8, 4, 128), (5, 2, 64), (16, 7, 64)])
@pytest.mark.parametrize("seqs", STEPS.values(), ids=STEPS.keys())
def test_bf16_rows_within_rounding_of_torch_in_fp32(make_random_step, seqs, block_size, group,
                                                    head_dim, window, kv_dtype, path):
    """A bf16 model's queries, keys and values over a bf16 pool (kv_cache_dtype auto) or an
    fp16 one: read in place and computed in fp32, the outputs rounded once to bf16."""
    step = make_random_step(block_size=block_size, num_kv_heads=3, group=group,
                            head_dim=head_dim, seqs=seqs, sliding_window=window, seed=7,
                            dtype=torch.bfloat16, kv_dtype=kv_dtype)
    assert_matches_torch(step, path)


@needs_kernel
def test_rows_and_pools_that_do_not_pair_are_refused(make_random_step):
    """fp32 rows over a bf16 pool, bf16 rows over an fp32 one: no kernel reads them (the
    engine never makes them: the pool takes the model dtype or fp16)."""
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=32, seqs=[(5, 1)])
    kernel = NativeAttentionBackend(step.spec)._kernel
    for rows, pool in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        with pytest.raises(RuntimeError, match="does not pair with"):
            kernel.store_kv(step.kv_cache.to(pool), step.key.to(rows), step.value.to(rows),
                            step.meta.slot_mapping)


@needs_kernel
@pytest.mark.parametrize("dtypes", POOL_DTYPES, ids=POOL_IDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shared_prefix_blocks_and_thread_splits(make_random_step, threads, path, dtypes):
    """Requests whose tables share their first blocks (a cached prefix), split over
    threads at item boundaries that fall inside a request's kv heads."""
    step = make_random_step(block_size=16, num_kv_heads=3, group=3, head_dim=64,
                            seqs=[(70, 1)] * 5 + [(20, 1)], seed=3, dtype=dtypes[0],
                            kv_dtype=dtypes[1])
    step.meta.block_tables[1:5, :3] = step.meta.block_tables[0, :3]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_torch(step, path)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtypes", POOL_DTYPES, ids=POOL_IDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 21])
def test_prefill_kernel_tiles_and_thread_shares(make_random_step, threads, window, dtypes,
                                                path):
    """Prefill chunks of many 16-position tiles over cached context, in requests sharing a
    prefix's blocks, spread over 1-3 threads by cost: the prefill kernel matches torch, and
    the decode token between them is the decode kernel's."""
    step = make_random_step(block_size=16, num_kv_heads=3, group=3, head_dim=64,
                            seqs=[(0, 130), (64, 71), (64, 16), (90, 1), (7, 33)],
                            sliding_window=window, seed=11, dtype=dtypes[0],
                            kv_dtype=dtypes[1])
    step.meta.block_tables[2, :4] = step.meta.block_tables[1, :4]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_torch(step, path)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_prefill_path_switch(make_random_step, monkeypatch):
    """prefill_path torch sends the chunks through the torch plan (the A/B switch, also
    CONVEYOR_PREFILL_ATTENTION); both paths give the same attention."""
    from conveyor.engine.attention.native_backend import PrefillRows
    from conveyor.engine.attention.torch_plan import TorchAttentionPlan

    step = make_random_step(block_size=8, num_kv_heads=3, group=3, head_dim=64,
                            seqs=[(20, 40), (5, 1)], seed=4)
    native = NativeAttentionBackend(step.spec)
    assert native.prefill_path == "native"  # auto, for an fp32 model
    assert isinstance(native.plan(step.meta).prefill, PrefillRows)
    if not native._kernel.has_avx512():
        with pytest.raises(ValueError, match="native-avx512 needs AVX-512"):
            NativeAttentionBackend(step.spec, prefill_path="native-avx512")
    monkeypatch.setenv("CONVEYOR_PREFILL_ATTENTION", "torch")
    via_torch = NativeAttentionBackend(step.spec)
    assert via_torch.prefill_path == "torch"
    assert isinstance(via_torch.plan(step.meta).prefill, TorchAttentionPlan)
    outs = [b.forward(step.query, step.key, step.value, step.kv_cache.clone(),
                      b.plan(step.meta)) for b in (native, via_torch)]
    assert (outs[0] - outs[1]).abs().max().item() <= TOLERANCE
    with pytest.raises(ValueError, match="prefill_path 'sdpa' is not one of"):
        NativeAttentionBackend(step.spec, prefill_path="sdpa")


@needs_kernel
@pytest.mark.parametrize("amx", [True, False])
def test_auto_sends_a_bf16_models_prefill_to_torch_sdpa_where_the_cpu_has_amx(
        make_random_step, monkeypatch, amx):
    """torch's bf16 SDPA runs on AMX tiles (oneDNN brgemm); without AMX, and for an fp32 model,
    the prefill kernel runs. Decode tokens take the decode kernel either way."""
    from conveyor.engine.attention.native_backend import PrefillRows
    from conveyor.engine.attention.torch_plan import TorchAttentionPlan
    from conveyor.engine.native import cpu_features as features_module

    found = features_module.cpu_features()
    monkeypatch.setattr(features_module, "cpu_features",
                        lambda: features_module.CpuFeatures(
                            found.avx2, found.avx512, found.avx512_vnni, found.avx512_bf16, amx))
    for dtype in (torch.bfloat16, torch.float32):
        step = make_random_step(block_size=8, num_kv_heads=3, group=3, head_dim=64,
                                seqs=[(20, 40), (5, 1)], seed=4, dtype=dtype)
        backend = NativeAttentionBackend(step.spec)
        sdpa = amx and dtype == torch.bfloat16
        assert backend.prefill_path == ("torch" if sdpa else "native")
        plan = backend.plan(step.meta)
        assert isinstance(plan.prefill, TorchAttentionPlan if sdpa else PrefillRows)
        if sdpa:  # the chunk is torch's own bf16 attention, the decode row the kernel's
            out = backend.forward(step.query, step.key, step.value, step.kv_cache.clone(),
                                  plan)
            reference = create_backend("torch", step.spec)
            expected = reference.forward(step.query, step.key, step.value,
                                         step.kv_cache.clone(), reference.plan(step.meta))
            assert torch.equal(out[:40], expected[:40])


@needs_kernel
def test_prefill_kernel_refuses_bad_rows(make_random_step):
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=32,
                            seqs=[(3, 5), (0, 2)])
    kernel = create_backend("native", step.spec)._kernel
    out = torch.empty_like(step.query)
    meta = step.meta
    lens, tables = meta.seq_lens, meta.block_tables

    def call(tables=tables, lens=lens, starts=(0, 5), qlens=(5, 2), query=step.query, isa=0):
        kernel.paged_prefill_attention(out, query, step.kv_cache, tables, lens,
                                       torch.tensor(starts), torch.tensor(qlens), 1.0, 0, isa)

    call()  # the rows as they are pass
    bad_block = tables.clone()
    bad_block[1, 0] = -1
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 0\] = -1 is not a block"):
        call(tables=bad_block)
    with pytest.raises(RuntimeError, match="request 1: query_len 3 and seq_len 2 must satisfy"):
        call(qlens=(5, 3))
    with pytest.raises(RuntimeError, match="request 1: tokens 6..8 are outside the query's 7"):
        call(starts=(0, 6))
    with pytest.raises(RuntimeError, match="seq_lens, query_starts and query_lens must be"):
        call(lens=lens.int())
    with pytest.raises(RuntimeError, match="query must be a .* with contiguous heads"):
        call(query=step.query.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="isa must be 0 .auto., 1 .AVX2. or 2 .AVX-512., got 3"):
        call(isa=3)


@needs_kernel
@pytest.mark.parametrize("path", ["avx512-cascade", "avx512"])
@pytest.mark.parametrize("dtypes", POOL_DTYPES, ids=POOL_IDS)
@pytest.mark.parametrize("num_sharing", [3, 6, 11, 17])
@pytest.mark.parametrize(("block_size", "group", "head_dim", "window"),
                         [(16, 3, 64, None), (4, 1, 32, None), (8, 4, 128, 30), (5, 2, 64, 23)])
def test_cascade_groups_requests_sharing_blocks(make_random_step, block_size, group, head_dim,
                                                window, num_sharing, dtypes, path):
    """Requests on two cached prefixes, interleaved, the first prefix's group of query rows
    from `num_sharing` requests (row counts that fill 16-row vectors, a last 8, or neither),
    one prefix ending inside a block they share, then each request's own blocks: the cascade
    (one pass over a shared block for all its requests' rows) matches torch, with either
    per-item code for the groups it leaves to one request."""
    lengths = [41 + 7 * (i % 5) for i in range(2 * num_sharing)]
    step = make_random_step(block_size=block_size, num_kv_heads=3, group=group,
                            head_dim=head_dim, seqs=[(n, 1) for n in lengths],
                            sliding_window=window, seed=5, dtype=dtypes[0],
                            kv_dtype=dtypes[1])
    tables = step.meta.block_tables
    prefix = 40 // block_size + 1  # the blocks holding tokens 0..40; the last one partly
    tables[2::2, :prefix] = tables[0, :prefix]  # requests 0, 2, 4, ...: the first prefix
    tables[3::2, :prefix] = tables[1, :prefix]  # requests 1, 3, 5, ...: the second
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # every request in one thread's range: the largest groups
    try:
        assert_matches_torch(step, path)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_kernel_paths_by_name(make_random_step):
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=32, seqs=[(5, 1)])
    auto = NativeAttentionBackend(step.spec)
    has_avx512 = auto._kernel.has_avx512()
    assert auto.kernel_path == ("avx512" if has_avx512 else "avx2")
    assert create_backend("native", step.spec).kernel_path == auto.kernel_path
    with pytest.raises(ValueError, match="kernel_path 'avx9' is not one of"):
        NativeAttentionBackend(step.spec, "avx9")
    if not has_avx512:
        for path in ("avx512-cascade", "avx512"):
            with pytest.raises(ValueError, match="needs AVX-512"):
                NativeAttentionBackend(step.spec, path)


@needs_kernel
def test_kernel_refuses_bad_tables_and_lengths(make_random_step):
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=32,
                            seqs=[(5, 1), (2, 1)])
    kernel = create_backend("native", step.spec)._kernel
    out = torch.empty_like(step.query)
    meta = step.meta

    def call(tables, lens, path=0):
        kernel.paged_decode_attention(out, step.query, step.kv_cache, tables, lens, 1.0, 0, path)

    bad_block = meta.block_tables.clone()
    bad_block[0, 0] = step.kv_cache.shape[1]
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = .* is not a block"):
        call(bad_block, meta.seq_lens)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 0 is outside"):
        call(meta.block_tables, torch.tensor([6, 0]))
    with pytest.raises(RuntimeError, match="block_tables must be a contiguous int32"):
        call(meta.block_tables.long(), meta.seq_lens)
    with pytest.raises(RuntimeError, match="path 4 is not one of 0..3"):
        call(meta.block_tables, meta.seq_lens, path=4)


@needs_kernel
def test_backend_refuses_what_the_kernel_does_not_cover(make_random_step):
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=16,
                            seqs=[(5, 1)])
    with pytest.raises(ValueError, match="head_dim .* set attention_backend torch"):
        create_backend("native", step.spec)
    step = make_random_step(block_size=4, num_kv_heads=1, group=2, head_dim=32,
                            seqs=[(5, 1)], dtype=torch.bfloat16, kv_dtype=torch.float32)
    backend = create_backend("native", step.spec)
    with pytest.raises(ValueError, match="not read torch.bfloat16 queries over a torch.float32"):
        backend.forward(step.query, step.key, step.value, step.kv_cache,
                        backend.plan(step.meta))


def test_a_failed_build_raises_naming_the_cause(tmp_path, monkeypatch):
    """No compiler: load_extension raises NativeBuildError (the caller falls back)."""
    monkeypatch.setenv("CONVEYOR_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    source = tmp_path / "probe.cpp"
    source.write_text("#include <torch/extension.h>\n"
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n")
    with pytest.raises(NativeBuildError, match="conveyor_build_probe did not build"):
        load_extension("conveyor_build_probe", [source])
    assert "conveyor_build_probe" not in sys.modules


def test_auto_falls_back_to_torch_when_the_kernel_is_unavailable(monkeypatch):
    from conveyor.engine.attention import native_kernel
    from conveyor.engine.settings import EngineSettings

    settings = EngineSettings(device="cpu")
    monkeypatch.setattr(native_kernel, "native_unavailable_reason", lambda: "no compiler")
    assert settings.resolved_attention_backend() == "torch"
    monkeypatch.setattr(native_kernel, "native_unavailable_reason", lambda: None)
    assert settings.resolved_attention_backend() == "native"
    assert EngineSettings(device="cpu", dtype="bfloat16").resolved_attention_backend() == "native"
    assert EngineSettings(device="cpu", attention_backend="torch").resolved_attention_backend() \
        == "torch"


@needs_kernel
def test_a_cached_build_loads_without_a_compiler():
    """Once built, the kernel imports from the cache with no compiler and no ninja (what
    the engine image relies on: it builds at image build time and drops the compiler)."""
    from conveyor.engine.attention.native_kernel import load_decode_kernel

    load_decode_kernel()
    code = ("from conveyor.engine.attention.native_kernel import load_decode_kernel; "
            "print(load_decode_kernel().__file__)")
    env = {**os.environ, "CXX": "/bin/false", "PATH": "/nonexistent"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("conveyor_paged_attention.so")


@pytest.fixture(scope="module")
def native_model(smollm2_folder):
    from conveyor.engine.model.loader import load_model

    return load_model(smollm2_folder, attention_backend="native")


@needs_kernel
@pytest.mark.slow
def test_greedy_batched_mixed_steps_match_transformers(native_model, make_driver, hf_model,
                                                        tokenizer):
    """The model on the native backend, prompts arriving over time under a token budget
    that mixes prefill chunks with decode tokens, sharing a prefix: transformers' greedy."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner

    prefix = "The river town woke slowly. Bakers lit their ovens before dawn. " * 6
    texts = ["The capital of France is", "def fibonacci(n):\n    ", prefix + "Then",
             prefix + "Meanwhile", "1, 2, 3, 4, 5,"]
    prompts = {f"p{i}": tokenizer(text)["input_ids"] for i, text in enumerate(texts)}
    runner = ModelRunner(EngineConfig(model="(preloaded)", attention_backend="native",
                                      block_size=16, num_blocks=256, max_model_len=1024,
                                      max_num_batched_tokens=512, max_num_seqs=16),
                         model=native_model)
    driver = make_driver(runner, token_budget=48, seed=2)
    outputs = driver.run({i: [(name, ids, 10)] for i, (name, ids) in enumerate(prompts.items())})
    assert driver.num_mixed_steps > 0
    for name, ids in prompts.items():
        with torch.inference_mode():
            reference = hf_model.generate(torch.tensor([ids]), do_sample=False,
                                          max_new_tokens=10, pad_token_id=2)[0, len(ids):]
        assert outputs[name][:len(reference)] == reference.tolist(), name


@needs_kernel
@pytest.mark.slow
def test_greedy_with_shared_prefix_blocks_matches_transformers(native_model, make_driver,
                                                               hf_model, tokenizer):
    """Four prompts on one prefix whose blocks they share in the pool, as prefix caching
    gives (the first request's prefill writes them, the others start past them): their
    decode steps take the cascade's shared groups (12 query rows a block, one thread, on
    auto where the CPU has AVX-512); greedy output is transformers'."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner

    prefix = "The river town woke slowly. Bakers lit their ovens before dawn. " * 6
    prompts = [tokenizer(prefix + tail)["input_ids"]
               for tail in ("Then", "Meanwhile", "Later that day", "At noon")]
    common = next(i for i in range(len(prompts[0]))
                  if len({tuple(p[:i + 1]) for p in prompts}) > 1)
    block_size = 16
    shared = common // block_size * block_size
    assert shared >= 4 * block_size
    runner = ModelRunner(EngineConfig(model="(preloaded)", attention_backend="native",
                                      block_size=block_size, num_blocks=256, max_model_len=1024,
                                      max_num_batched_tokens=512, max_num_seqs=16),
                         model=native_model)
    driver = make_driver(runner, token_budget=48, seed=2)
    driver.add("p0", prompts[0], 10)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # all four requests in one thread's items: groups of 12 rows
    try:
        while driver.requests[0].num_computed < shared:
            driver.step()
        for i, ids in enumerate(prompts[1:], start=1):
            driver.add(f"p{i}", ids, 10)
            driver.requests[i].block_table = driver.requests[0].block_table[:shared // block_size]
            driver.requests[i].num_computed = shared
        outputs = driver.run()
    finally:
        torch.set_num_threads(previous)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            reference = hf_model.generate(torch.tensor([ids]), do_sample=False,
                                          max_new_tokens=10, pad_token_id=2)[0, len(ids):]
        assert outputs[f"p{i}"][:len(reference)] == reference.tolist(), i


@needs_kernel
@pytest.mark.slow
def test_greedy_over_an_fp16_pool_is_torch_over_the_same_pool(native_model, smollm2_model,
                                                               make_driver, tokenizer):
    """kv_cache_dtype float16, prompts arriving over time with mixed steps and a shared
    prefix: the native kernels' greedy output is the torch backend's over the same fp16
    pool (both read the same rounded keys and values), token for token."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner

    prefix = "The river town woke slowly. Bakers lit their ovens before dawn. " * 6
    texts = ["The capital of France is", "def fibonacci(n):\n    ", prefix + "Then",
             prefix + "Meanwhile", "1, 2, 3, 4, 5,"]
    prompts = {f"p{i}": tokenizer(text)["input_ids"] for i, text in enumerate(texts)}
    outputs = []
    for backend, model in (("native", native_model), ("torch", smollm2_model)):
        runner = ModelRunner(EngineConfig(model="(preloaded)", attention_backend=backend,
                                          kv_cache_dtype="float16", block_size=16,
                                          num_blocks=256, max_model_len=1024,
                                          max_num_batched_tokens=512, max_num_seqs=16),
                             model=model)
        assert runner.kv_caches[0].dtype == torch.float16
        driver = make_driver(runner, token_budget=48, seed=2)
        outputs.append(driver.run({i: [(name, ids, 12)]
                                   for i, (name, ids) in enumerate(prompts.items())}))
        assert driver.num_mixed_steps > 0
    assert outputs[0] == outputs[1]


@needs_kernel
def test_the_kernel_releases_the_gil(make_random_step, wakeups_during):
    """The engine's asyncio/gRPC thread runs while a decode step's attention does."""
    step = make_random_step(block_size=16, num_kv_heads=3, group=3, head_dim=64,
                            seqs=[(2000, 1)] * 16)
    backend = NativeAttentionBackend(step.spec)
    plan = backend.plan(step.meta)
    query = step.query.contiguous()
    out = torch.empty_like(query)

    def kernel_calls():
        for _ in range(10):
            backend._kernel.paged_decode_attention(out, query, step.kv_cache, plan.block_tables,
                                                   plan.seq_lens, step.spec.scale, 0, 0)

    assert_other_threads_run(wakeups_during, kernel_calls)


def assert_other_threads_run(wakeups_during, kernel_calls) -> None:
    during, elapsed = wakeups_during(kernel_calls)
    assert elapsed > 0.003, "the kernel ran too briefly to tell"
    assert during >= 3, f"{during} wake-ups in {elapsed * 1e3:.1f} ms of kernel calls"


@needs_kernel
def test_the_prefill_kernel_releases_the_gil(make_random_step, wakeups_during):
    """The engine's asyncio/gRPC thread runs while a prefill chunk's attention does."""
    step = make_random_step(block_size=16, num_kv_heads=3, group=3, head_dim=64,
                            seqs=[(256, 512)])
    backend = NativeAttentionBackend(step.spec)
    plan = backend.plan(step.meta)

    def kernel_calls():
        for _ in range(5):
            backend._prefill(step.query, step.kv_cache, plan.prefill)

    assert_other_threads_run(wakeups_during, kernel_calls)


@needs_kernel
@pytest.mark.parametrize("num_kv_heads", [3, 1])
def test_queries_keys_and_values_are_read_where_the_projection_wrote_them(make_random_step,
                                                                         num_kv_heads):
    """q, k and v as the model passes them (views of one [T, (H + 2 Hkv) * D] projection, rows
    strided): stored by the backend's C++ store and attended without a copy, as torch does with
    contiguous copies; the C++ store writes exactly what torch's index_copy_ store writes."""
    from conveyor.engine.attention.torch_backend import store_kv

    step = make_random_step(block_size=8, num_kv_heads=num_kv_heads, group=3, head_dim=64,
                            seqs=[(20, 40), (5, 1), (0, 17)], seed=9)
    heads = step.spec.num_heads + 2 * num_kv_heads
    qkv = torch.randn(step.query.shape[0], heads, 64)
    query, key, value = qkv.split([step.spec.num_heads, num_kv_heads, num_kv_heads], dim=1)
    assert not query.is_contiguous() and not key.is_contiguous()
    native = NativeAttentionBackend(step.spec)
    reference = create_backend("torch", step.spec)
    native_pool, torch_pool = step.kv_cache.clone(), step.kv_cache.clone()
    out = native.forward(query, key, value, native_pool, native.plan(step.meta))
    expected = reference.forward(query.contiguous(), key.contiguous(), value.contiguous(),
                                 torch_pool, reference.plan(step.meta))
    assert torch.equal(native_pool, torch_pool)
    assert (out - expected).abs().max().item() <= TOLERANCE
    expected_pool = step.kv_cache.clone()  # every row but the last stored, as torch does
    store_kv(key[:-1].contiguous(), value[:-1].contiguous(), expected_pool,
             step.meta.slot_mapping[:-1])
    padded = torch.cat([step.meta.slot_mapping[:-1], torch.tensor([-1])])  # a padding slot
    padded_pool = step.kv_cache.clone()
    native._kernel.store_kv(padded_pool, key, value, padded)
    assert torch.equal(padded_pool, expected_pool)  # the padding row written nowhere
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = .* is past the pool's"):
        native._kernel.store_kv(native_pool, key, value,
                                torch.full_like(padded, native_pool[0].numel()))


@needs_kernel
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the kernel with")
def test_the_decode_kernel_prefetches_the_next_block_for_every_head_dim_and_pool():
    """Each decode walk (attend_items, attend_items_cascade) of every head dim and pool type
    asks for the next block's rows ahead: GCC 12 once dropped every _mm_prefetch of a row
    longer than one cache line, and the bf16 kernel ran 1.6x slower streaming the pool unasked
    (docs/performance.md, issue 33)."""
    from conveyor.engine.attention.native_kernel import load_decode_kernel

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn",
                              load_decode_kernel().__file__],
                             capture_output=True, text=True, check=True).stdout
    walks_with_prefetch, function = set(), ""
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line
        elif "prefetcht0" in line:
            walks_with_prefetch.add(function)
    for walk in ("attend_items", "attend_items_cascade"):
        for dim in (32, 64, 128):
            for pool in ("f", "N3c104Half", "N3c108BFloat16"):
                symbol = f"{len(walk)}{walk}ILi{dim}E{pool}"
                assert any(symbol in f for f in walks_with_prefetch), (walk, dim, pool)
