"""Prometheus metrics, named as vLLM names them under the ``pagedserve:`` prefix.

Dashboards built for vLLM adapt by renaming ``vllm:`` to ``pagedserve:``. Each app owns a
private ``CollectorRegistry`` (tests run several apps in one process). Two sources:

* per-request latencies, observed by the server from each request's engine timestamps
  (monotonic seconds set by the engine thread: arrival, first scheduled, first token,
  last token, finished);
* engine gauges and counters, read at scrape time from ``AsyncEngine.snapshot``, which the
  step thread republishes after every step and every abort, so an idle engine reads 0
  (the pools' exact counts among them: owned blocks, leased state slots, live sequences),
  and the admission count (engine requests admitted and not yet released).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.request import Request
from pagedserve.server.admission import Admission

PREFIX = "pagedserve:"

# vLLM's buckets, so histogram_quantile() over the two servers compares like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Scrape-time view of the engine's snapshot."""

    def __init__(self, engine: AsyncEngine, model_name: str,
                 admission: Admission | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        gauges: tuple[tuple[str, str, float], ...] = (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc",
             "Fraction of K/V blocks owned by requests (0 to 1; cached ones count free).",
             s.kv_cache_usage),
            # The pools' exact counts: all 0 on an idle engine unless something leaked.
            ("kv_cache_used_blocks", "K/V blocks owned by sequences.", s.num_used_blocks),
            ("state_slots_used", "Recurrent-state slots leased to sequences.",
             s.num_used_state_slots),
            ("num_live_sequences", "Sequence rows (block tables) in use.", s.num_live_seqs),
        )
        if self.admission is not None:
            gauges += (("num_requests_admitted", "Engine requests admitted and not yet "
                        "released (the --max-queue bound counts these).",
                        self.admission.num_in_flight),)
        checkpoint_use = (s.num_prefix_checkpoints / s.prefix_checkpoint_capacity
                          if s.prefix_checkpoint_capacity else 0.0)
        gauges += (
            ("prefix_checkpoint_usage_perc",
             "Fraction of the prefix cache's state checkpoints in use (0 to 1).",
             checkpoint_use),
            ("prefix_checkpoints", "Recurrent-state checkpoints held by the prefix cache.",
             s.num_prefix_checkpoints),
        )
        if s.spec_decode_num_drafts:
            # vLLM's "mean acceptance length": tokens a sequence gains per verify step, the
            # bonus token included (1 + k when every draft token is accepted).
            gauges += (("spec_decode_mean_acceptance_length",
                        "Tokens emitted per speculative verify of one sequence (1 + accepted "
                        "draft tokens per draft), since start-up.",
                        1.0 + s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts),)
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters: tuple[tuple[str, str, int], ...] = (
            ("num_preemptions", "Requests preempted (blocks freed, recomputed later).",
             s.num_preemptions),
            ("prompt_tokens", "Prompt tokens prefilled.", s.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens),
            ("prefix_cache_queries", "Prefix cache queries, in tokens.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hits),
        )
        if s.spec_decode_num_accepted_tokens_per_pos:
            counters += (
                ("spec_decode_num_drafts", "Speculative verifies (one per sequence and "
                 "step).", s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                 s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_decode_num_accepted_tokens),
            )
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        if s.spec_decode_num_accepted_tokens_per_pos:
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.",
                                    labels=["model_name", "position"])
            for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                c.add_metric([self.model_name, str(pos)], value)
            yield c


class ServerMetrics:
    """The app's metrics; ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine: AsyncEngine, model_name: str,
                 admission: Admission | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name, admission))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time between a request's output tokens, after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", LATENCY_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def on_first_token(self, req: Request) -> None:
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)

    def on_finished(self, req: Request, finish_reason: str) -> None:
        """A request ended (``abort`` included; latencies only for complete ones)."""
        self._success.labels(self.model_name, finish_reason).inc()
        if finish_reason == "abort" or req.finished_time is None:
            return
        self.e2e.observe(req.finished_time - req.arrival_time)
        num_out = len(req.output_token_ids)
        if num_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
            self.tpot.observe((req.last_token_time - req.first_token_time) / (num_out - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
