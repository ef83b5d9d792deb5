"""Prometheus metrics of one server: each app gets its own registry (tests build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; CPU models answer in tens of milliseconds to several seconds per token.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Every metric the server exposes on ``/metrics``, registered in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("verispec_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of admitted generation requests", registry=r)
        self.reused_prompt_tokens = Counter("verispec_reused_prompt_tokens", "Prompt tokens restored from the prefix cache instead of prefilled", registry=r)
        self.generated_tokens = Counter("verispec_generated_tokens", "Tokens generated (streamed to clients or not)", registry=r)
        self.time_to_first_token = Histogram("verispec_time_to_first_token_seconds", "From request arrival to its first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_token = Histogram("verispec_time_per_output_token_seconds", "Time between a request's emissions divided by the tokens emitted, per token after the first", buckets=_LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("verispec_drafts", "Per-request rounds that verified at least one draft token", registry=r)
        self.draft_tokens = Counter("verispec_draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.accepted_tokens = Counter("verispec_accepted_tokens", "Draft tokens accepted by verification", registry=r)
        self.accepted_by_position = Counter("verispec_accepted_tokens_by_position", "Accepted draft tokens by their position in the draft (0 = first)", ["position"], registry=r)
        self.gamma = Gauge("verispec_gamma", "Most drafts per request in the latest round (the batch-size policy's cap)", registry=r)
        self.round_drafts = Gauge("verispec_round_drafts", "Drafts of all requests together in the latest round (the batch planner's plan, probes included)", registry=r)
        self.queue_length = Gauge("verispec_queue_length", "Requests waiting to join the running batch", registry=r)
        self.running = Gauge("verispec_running_batch_size", "Requests in the running batch", registry=r)
        self.target_calls = Counter("verispec_target_calls", "Batched target verification passes", registry=r)
        # Rolling (last rounds) acceptance per scope: "global" and one "key:<id>" per API key.
        self.rolling_alpha = Gauge("verispec_rolling_acceptance_rate", "Accepted / drafted tokens over the scope's recent rounds", ["scope"], registry=r)
        self.rolling_tau = Gauge("verispec_rolling_tokens_per_call", "Tokens per target call over the scope's recent rounds", ["scope"], registry=r)
        self.rolling_speedup = Gauge("verispec_rolling_speedup", "Realised speed-up over plain decoding over the scope's recent rounds (per request, estimated)", ["scope"], registry=r)
        self.below_floor = Counter("verispec_speculation_below_floor", "Times a scope's realised speed-up (or acceptance) fell below the monitor's floor", registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
