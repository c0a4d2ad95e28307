"""The engine's Prometheus metrics, with vLLM's names so dashboards and probes carry over.

One registry per server (tests run several engines in one process). These are
the engine's own metrics, not ftctl's (`dynamo_ftctl.metrics`): a real vLLM
exports the same names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["EngineMetrics"]

# vLLM's TTFT buckets (vllm/v1/metrics/loggers.py), trimmed to the range a CPU engine sees.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                60.0)


class EngineMetrics:
    """vLLM-named gauges, counters and histograms for one served model."""

    def __init__(self, model_name: str, *, block_size: int | None = None,
                 num_blocks: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.",
                             ["model_name"], registry=r).labels(**labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for KV blocks.",
                             ["model_name"], registry=r).labels(**labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).",
                              ["model_name"], registry=r).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.",
                                         ["model_name"], registry=r).labels(**labels)
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=r).labels(**labels)
        self._model_name = model_name
        if block_size is not None and num_blocks is not None:
            # vLLM's info gauge (value 1, the settings in labels): a proxy reads the pool's
            # size from it to turn the blocks its own requests hold into a usage figure
            # between two scrapes (`proxy.admission`).
            Gauge("vllm:cache_config_info", "Information of the LLM engine's KV cache.",
                  ["block_size", "num_gpu_blocks"], registry=r,
                  ).labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)

    class _Reason:
        def __init__(self, counter: Counter, model_name: str) -> None:
            self._counter = counter
            self._model_name = model_name

        def labels(self, *, finished_reason: str) -> Counter:
            return self._counter.labels(model_name=self._model_name,
                                        finished_reason=finished_reason)

    @property
    def request_success(self) -> EngineMetrics._Reason:
        """`vllm:request_success_total`, labelled by finish reason."""
        return EngineMetrics._Reason(self._success, self._model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (no `_created` series, as in
        every ftctl process: `httpapp.metrics_reply`)."""
        from prometheus_client import disable_created_metrics, generate_latest

        disable_created_metrics()  # type: ignore[no-untyped-call]
        return generate_latest(self.registry)
