"""A load generator for the concurrency table: N clients streaming chat requests at once.

Each level of concurrency runs ``concurrency`` clients; each client sends ``requests_per_client``
streamed chat requests one after another (different HumanEval prompts). Reported per level:
total generated tokens / wall time, median and p90 request latency, median time to first token, and
the median decoding rate of a request after its first token.

Several servers side by side (``--url NAME=URL`` repeated, ``--repeat N``): each level runs on every
server in turn, in an order that reverses every run (A B, B A, A B ...), so a machine that drifts
over minutes slows both alike; reported per level and server: the median total tokens/s over the
runs (and its range), and the median of the per-run ratios to the first server — ratios measured
side by side, as the benchmarks report them.

``conversation``: each client's requests are the turns of one chat instead — its first HumanEval
prompt, then the conversation so far (every answer included) plus a follow-up request
(:data:`FOLLOW_UPS`) — and the median time to first token of the later turns is reported apart:
what a server that reuses the conversation's earlier prefill (``--prefix-cache-mb``) saves.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


FOLLOW_UPS = (
    "Add type hints and a docstring with an example.",
    "Now write three unit tests for it with pytest.",
    "Make it faster if you can, and explain the change in one sentence.",
    "Rewrite it without any imports.",
)


@dataclass(frozen=True)
class RequestTiming:
    latency_s: float
    ttft_s: float
    tokens: int
    text: str = ""
    turn: int = 1
    prompt_tokens: int | None = None  # as the server's usage counts them


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    tokens_per_s: float
    median_latency_s: float
    p90_latency_s: float
    median_ttft_s: float
    requests: int
    median_followup_ttft_s: float | None = None  # conversations: turns 2+ only
    median_ttft_by_turn: tuple[float, ...] = ()  # conversations: turn 1, 2, ... (a window or a cache shows where turns grow long)
    prompt_tokens: tuple[int, int, int] | None = None  # (min, median, max) over the requests, from the server's usage
    # Per request, its tokens after the first over the time after its first token: the decoding
    # rate a client sees, without the wait for its prefill (which short answers are mostly made of).
    median_decode_tokens_per_s: float | None = None


async def _one_request(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int, turn: int = 1) -> RequestTiming:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    ttft, tokens, text, prompt_tokens = None, 0, [], None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"{url}: {chunk['error']['message']}")
                pieces = [choice["delta"].get("content") or "" for choice in chunk["choices"]]
                if ttft is None and any(pieces):
                    ttft = time.perf_counter() - started
                text += pieces
                if chunk.get("usage"):
                    tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"].get("prompt_tokens")
    except httpx.HTTPError as error:  # the server went away mid-test (or never answered): say which, no traceback
        raise RuntimeError(f"{url}: a request failed after {time.perf_counter() - started:.1f} s: {type(error).__name__}: {error}") from error
    latency = time.perf_counter() - started
    return RequestTiming(latency, ttft if ttft is not None else latency, tokens, "".join(text), turn, prompt_tokens)


async def run_level(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, requests_per_client: int, api_key: str | None, conversation: bool = False
) -> LevelResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def one_client(index: int) -> list[RequestTiming]:
            if conversation:  # one chat: its first prompt, then follow-ups on the whole conversation
                messages, timings = [{"role": "user", "content": prompts[index % len(prompts)]}], []
                for turn in range(1, requests_per_client + 1):
                    timing = await _one_request(client, url, model, messages, max_tokens, turn)
                    timings.append(timing)
                    messages += [{"role": "assistant", "content": timing.text}, {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}]
                return timings
            chosen = [prompts[(index * requests_per_client + i) % len(prompts)] for i in range(requests_per_client)]
            return [await _one_request(client, url, model, [{"role": "user", "content": prompt}], max_tokens) for prompt in chosen]

        started = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
    timings = [t for client_timings in per_client for t in client_timings]
    latencies = sorted(t.latency_s for t in timings)
    return LevelResult(
        concurrency=concurrency,
        tokens_per_s=sum(t.tokens for t in timings) / wall,
        median_latency_s=statistics.median(latencies),
        p90_latency_s=latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        median_ttft_s=statistics.median(t.ttft_s for t in timings),
        requests=len(timings),
        median_followup_ttft_s=statistics.median(later) if (later := [t.ttft_s for t in timings if t.turn > 1]) else None,
        median_ttft_by_turn=_median_ttft_by_turn(timings) if conversation else (),
        prompt_tokens=_spread([t.prompt_tokens for t in timings if t.prompt_tokens is not None]),
        median_decode_tokens_per_s=_median_decode_rate(timings),
    )


def _spread(values: list[int]) -> tuple[int, int, int] | None:
    """(min, median, max) of ``values``, None when there are none."""
    return (min(values), int(statistics.median(values)), max(values)) if values else None


def _median_decode_rate(timings: list[RequestTiming]) -> float | None:
    """Median over the requests of (tokens - 1) / (latency - TTFT); None if no request streamed 2+ tokens."""
    rates = [(t.tokens - 1) / (t.latency_s - t.ttft_s) for t in timings if t.tokens > 1 and t.latency_s > t.ttft_s]
    return statistics.median(rates) if rates else None


def _median_ttft_by_turn(timings: list[RequestTiming]) -> tuple[float, ...]:
    """Median time to first token of each turn number, 1 first."""
    turns = range(1, max(t.turn for t in timings) + 1)
    return tuple(statistics.median(t.ttft_s for t in timings if t.turn == turn) for turn in turns)


async def served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        try:
            response = await client.get(f"{url}/v1/models")
            response.raise_for_status()
        except httpx.HTTPError as error:  # nothing listening, a wrong key: say which server, no traceback
            raise RuntimeError(f"cannot list the models of {url}: {error}") from error
        return response.json()["data"][0]["id"]


def format_table(results: list[LevelResult]) -> str:
    followups = any(r.median_followup_ttft_s is not None for r in results)
    header = "| concurrency | requests | total tok/s | median latency (s) | p90 latency (s) | median TTFT (s) | median decode tok/s per request |" + (" median TTFT, turns 2+ (s) |" if followups else "")
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if followups else "")]
    for r in results:
        decode = "-" if r.median_decode_tokens_per_s is None else f"{r.median_decode_tokens_per_s:.2f}"
        line = f"| {r.concurrency} | {r.requests} | {r.tokens_per_s:.2f} | {r.median_latency_s:.2f} | {r.p90_latency_s:.2f} | {r.median_ttft_s:.2f} | {decode} |"
        if followups:
            line += " - |" if r.median_followup_ttft_s is None else f" {r.median_followup_ttft_s:.2f} |"
        lines.append(line)
    for r in results:
        if r.prompt_tokens is not None:
            low, middle, high = r.prompt_tokens
            lines.append(f"concurrency {r.concurrency}, prompt tokens per request (server usage): median {middle} (min {low}, max {high})")
    for r in results:
        if r.median_ttft_by_turn:
            by_turn = ", ".join(f"{turn}: {ttft:.2f}" for turn, ttft in enumerate(r.median_ttft_by_turn, 1))
            lines.append(f"concurrency {r.concurrency}, median TTFT (s) by turn: {by_turn}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Served:
    """A server under test: its label in the tables and its base URL."""

    name: str
    url: str


def parse_servers(values: list[str]) -> list[Served]:
    """``URL`` or ``NAME=URL`` per value (the label defaults to the URL); names must differ."""
    servers = []
    for value in values:
        name, separator, url = value.partition("=")
        if not separator or "://" in name:  # a bare URL (its query string may hold '=')
            name, url = value, value
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be URL or NAME=URL with an http(s) URL, got {value!r}")
        servers.append(Served(name, url.rstrip("/")))
    names = [server.name for server in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"--url names must differ, got {names}")
    return servers


def side_by_side_order(servers: list[Served], run: int) -> list[Served]:
    """The servers in the order run ``run`` (0-based) visits them at each level: reversed every other run."""
    return list(servers) if run % 2 == 0 else list(reversed(servers))


def format_comparison(levels: list[int], servers: list[Served], results: dict[tuple[int, str], list[LevelResult]]) -> str:
    """One row per (level, server) from ``results[(level index, name)]``, one LevelResult per run:
    total tokens/s as median (min-max) over the runs, the median (min-max) of each run's ratio to the
    first server's tokens/s at that level, and medians over the runs of the request decode rate and TTFT."""
    first = servers[0].name
    runs = len(results[(0, first)])
    lines = [
        f"| concurrency | server | total tok/s, median (min-max) of {runs} | vs {first}, median (min-max) | median decode tok/s per request | median TTFT (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for index, level in enumerate(levels):
        for server in servers:
            runs_here = results[(index, server.name)]
            rates = [r.tokens_per_s for r in runs_here]
            ratios = [r.tokens_per_s / base.tokens_per_s for r, base in zip(runs_here, results[(index, first)])]
            decodes = [r.median_decode_tokens_per_s for r in runs_here if r.median_decode_tokens_per_s is not None]
            decode = f"{statistics.median(decodes):.2f}" if decodes else "-"
            ttft = statistics.median(r.median_ttft_s for r in runs_here)
            lines.append(
                f"| {level} | {server.name} | {statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {decode} | {ttft:.2f} |"
            )
    return "\n".join(lines)


def format_finished(levels: list[int], servers: list[Served], results: dict[tuple[int, str], list[LevelResult]]) -> str:
    """What a load test that stopped early had measured: per server and run, the table of the levels
    it finished (``results`` as :func:`format_comparison` takes them, each list as long as the runs done)."""
    parts = []
    for server in servers:
        runs = max(len(results[(index, server.name)]) for index in range(len(levels)))
        for run in range(runs):  # a server that finished nothing has no table
            done = [results[(index, server.name)][run] for index in range(len(levels)) if len(results[(index, server.name)]) > run]
            label = server.name + (f", run {run + 1}" if runs > 1 else "")
            parts.append(f"finished before the error ({label}):\n{format_table(done)}")
    return "\n\n".join(parts)
