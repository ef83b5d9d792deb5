"""A load generator for the concurrency table: N clients streaming chat requests at once.

Each level of concurrency runs ``concurrency`` clients; each client sends ``requests_per_client``
streamed chat requests one after another (different HumanEval prompts). Reported per level:
total generated tokens / wall time, median and p90 request latency, median time to first token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class RequestTiming:
    latency_s: float
    ttft_s: float
    tokens: int


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    tokens_per_s: float
    median_latency_s: float
    p90_latency_s: float
    median_ttft_s: float
    requests: int


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - started
    return RequestTiming(latency, ttft if ttft is not None else latency, tokens)


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, requests_per_client: int, api_key: str | None) -> LevelResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def one_client(index: int) -> list[RequestTiming]:
            chosen = [prompts[(index * requests_per_client + i) % len(prompts)] for i in range(requests_per_client)]
            return [await _one_request(client, url, model, prompt, max_tokens) for prompt in chosen]

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
    )


async def served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def format_table(results: list[LevelResult]) -> str:
    lines = ["| concurrency | requests | total tok/s | median latency (s) | p90 latency (s) | median TTFT (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.concurrency} | {r.requests} | {r.tokens_per_s:.2f} | {r.median_latency_s:.2f} | {r.p90_latency_s:.2f} | {r.median_ttft_s:.2f} |")
    return "\n".join(lines)
