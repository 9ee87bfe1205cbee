"""Prometheus metrics under vLLM's names, types, labels and buckets, served over HTTP.

The engine exports what vLLM's engine exports (`vllm:num_requests_waiting`,
`vllm:time_to_first_token_seconds`, `vllm:request_success_total{finished_reason}`, ...,
each labelled `model_name` and `engine`), so dashboards, autoscalers (KEDA) and the
Gateway API inference extension written for vLLM read a Conveyor engine unchanged.
The names replace the earlier `conveyor:` copies of the same quantities (one series per
quantity, not two); what vLLM has no name for keeps the `conveyor:` prefix
(`conveyor:num_requests_shed_total`). The `engine` label is the engine's registry id
(vLLM's is its engine index). Counters are exported with the `_total` suffix, as vLLM's are.

Each EngineMetrics owns its registry (no process-wide state), so tests can build several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.iteration_stats import FinishedRequestStats, IterationStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort")
"""The finished_reason label values of vllm:request_success_total (vLLM's FinishReason)."""


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    """Gauges from EngineStats snapshots, counters and histograms from IterationStats."""

    def __init__(self, model_name: str, engine_id: str, max_model_len: int = 2048):
        self.registry = CollectorRegistry()
        self._labels = (model_name, engine_id)
        self._engine_id = engine_id
        self._last = EngineStats()
        self.lora_requests_info: Gauge | None = None
        """Set up by track_lora_requests (an engine serving LoRA adapters)."""
        self._build_gauges()
        self._build_counters()
        self._build_latency_histograms()
        self._build_size_histograms(max_model_len)

    @classmethod
    def for_engine(cls, info: EngineInfo) -> EngineMetrics:
        """The metrics of a running engine, with its cache configuration as
        vllm:cache_config_info."""
        metrics = cls(info.model, info.engine_id, info.max_model_len)
        metrics.record_cache_config(info.block_size, info.num_blocks, info.dtype)
        if info.max_loras:
            metrics.track_lora_requests(info.max_loras)
        return metrics

    def track_lora_requests(self, max_loras: int) -> None:
        """vllm:lora_requests_info from now on: one series whose labels name the adapters of
        the running and waiting requests (comma-separated) and max_lora, set to the time of
        the snapshot; the previous series is dropped at each change."""
        self._max_loras = max_loras
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"),
            registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        metric = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
        return metric.labels(*self._labels)

    def _build_gauges(self) -> None:
        self.num_requests_running = self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def _build_counters(self) -> None:
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens",
                                           "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens",
                                               "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=self.registry)
        self.request_success = {reason: success.labels(*self._labels, reason)
                                for reason in FINISHED_REASONS}
        self._build_spec_decode_counters()
        self.num_requests_shed = self._counter(
            "conveyor:num_requests_shed",
            "Requests refused or pushed out of the full waiting queue.")

    def _build_spec_decode_counters(self) -> None:
        self.spec_decode_num_drafts = self._counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = self._counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = self._counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._accepted_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", (*LABELS, "position"),
            registry=self.registry)

    def _build_latency_histograms(self) -> None:
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = self._histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = self._histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

    def _build_size_histograms(self, max_model_len: int) -> None:
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.request_params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS)

    def record_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str) -> None:
        """vllm:cache_config_info, a gauge set to 1 whose labels are the configuration."""
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "num_gpu_blocks", "cache_dtype", "engine"),
                     registry=self.registry)
        info.labels(str(block_size), str(num_blocks), cache_dtype, self._engine_id).set(1)

    def record_stats(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters that the snapshot holds as totals."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        if self.lora_requests_info is not None:
            self._record_lora_requests(stats)
        last, self._last = self._last, stats
        _advance(self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries)
        _advance(self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits)
        _advance(self.num_preemptions, stats.num_preemptions, last.num_preemptions)
        _advance(self.num_requests_shed, stats.num_requests_shed, last.num_requests_shed)

    def _record_lora_requests(self, stats: EngineStats) -> None:
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(
            str(self._max_loras), ",".join(stats.waiting_lora_adapters),
            ",".join(stats.running_lora_adapters), self._engine_id).set_to_current_time()

    def record_iteration(self, iteration: IterationStats) -> None:
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.num_scheduled_tokens:
            self.iteration_tokens.observe(iteration.num_scheduled_tokens)
        _observe_all(self.time_to_first_token, iteration.time_to_first_token)
        _observe_all(self.inter_token_latency, iteration.inter_token_latency)
        _observe_all(self.request_queue_time, iteration.queue_time)
        self._record_drafts(iteration)
        for finished in iteration.finished:
            self._record_finished(finished)

    def _record_drafts(self, iteration: IterationStats) -> None:
        if not iteration.num_drafts:
            return
        self.spec_decode_num_drafts.inc(iteration.num_drafts)
        self.spec_decode_num_draft_tokens.inc(iteration.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(iteration.num_accepted_tokens)
        for position, count in enumerate(iteration.accepted_per_position):
            self._accepted_per_position.labels(*self._labels, str(position)).inc(count)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        counter = self.request_success.get(finished.finish_reason)
        if counter is not None:
            counter.inc()
        self.e2e_request_latency.observe(finished.e2e_latency)
        self.request_inference_time.observe(finished.inference_time)
        self.request_prefill_time.observe(finished.prefill_time)
        self.request_decode_time.observe(finished.decode_time)
        if finished.num_generation_tokens > 1:
            self.request_time_per_output_token.observe(
                finished.decode_time / (finished.num_generation_tokens - 1))
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        self.request_params_max_tokens.observe(finished.max_tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on `port` from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)


def _observe_all(histogram: Histogram, values: list[float]) -> None:
    for value in values:
        histogram.observe(value)


def _advance(counter: Counter, total: int, last_total: int) -> None:
    counter.inc(max(0, total - last_total))
