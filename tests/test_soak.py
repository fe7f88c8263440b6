"""Soak: the real server (the tiny demo Gemma 4 with its MTP assistant, on CPU) under a bounded
stream of mixed requests at concurrency 16, with clients that disconnect mid-stream, give up
while their request waits or runs, or leave before the first byte. Asserts what an operator
needs: no 5xx, no hang (every request ends within its timeout), and afterwards every KV page free
and nothing running or waiting. Bounded: a fixed number of short requests (about a minute here)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
from fake_engine import metric, wait_for_free_pages
from test_server_real import start_server

pytestmark = pytest.mark.timeout(600)

NUM_REQUESTS = 480
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 120.0  # a request still open after this is a hang
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gemma4serve.demo.checkpoints import ensure_demo_model

    target, assistant = ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))
    with start_server(target, assistant, "--max-model-len", "1024") as proc:
        yield proc


def _body(rng: random.Random, i: int, path: str, stream: bool) -> dict:
    body = {
        "max_tokens": rng.randint(4, 48),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": stream,
        "ignore_eos": rng.random() < 0.5,
    }
    if path == CHAT:
        body["messages"] = [
            {"role": "user", "content": f"request {i}: " + "tell me more " * rng.randint(1, 30)}
        ]
    else:
        body["prompt"] = f"request {i}: " + "once upon a time " * rng.randint(1, 30)
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["the", "a", "\n", "zz"]) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.2:
        body["logprobs"] = True if path == CHAT else 2
        if path == CHAT:
            body["top_logprobs"] = 2
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One request of a random kind; returns what happened ("200", "400", "disconnected", ...)."""
    path = rng.choice([CHAT, COMPLETIONS])
    kind = rng.choice(
        ["stream", "stream", "whole", "drop-mid-stream", "give-up", "leave-early", "bad"]
    )
    stream = kind in ("stream", "drop-mid-stream", "leave-early")
    body = _body(rng, i, path, stream)
    if kind == "bad":
        body["temperature"] = -1
    if kind == "give-up":  # the client times out while its request waits or runs
        body.update(max_tokens=300, ignore_eos=True)
        try:
            response = await client.post(path, json=body, timeout=rng.uniform(0.05, 1.0))
            return str(response.status_code)
        except httpx.TimeoutException:
            return "gave up"
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200 or not stream:
            await response.aread()
            return str(response.status_code)
        if kind == "leave-early":
            return "left early"  # closed before reading a byte of the stream
        chunks = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if kind == "drop-mid-stream" and chunks >= rng.randint(1, 6):
                    return "disconnected"
                if line == "data: [DONE]":
                    return "200"
        return "stream ended without [DONE]"


def test_soak_with_disconnects_and_aborts(server):
    async def run() -> Counter:
        rng = random.Random(20261124)
        seeds = [rng.getrandbits(32) for _ in range(NUM_REQUESTS)]
        gate = asyncio.Semaphore(CONCURRENCY)
        outcomes: Counter = Counter()
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        # The client waits as long as the hang bound, so a slow request is judged by that bound.
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as client:

            async def bounded(i: int) -> None:
                async with gate:
                    try:
                        outcome = await asyncio.wait_for(
                            _one(client, random.Random(seeds[i]), i), REQUEST_TIMEOUT_S
                        )
                    except asyncio.TimeoutError:
                        outcome = "hung"
                    outcomes[outcome] += 1

            await asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))
        return outcomes

    outcomes = asyncio.run(run())
    assert sum(outcomes.values()) == NUM_REQUESTS
    failures = {
        k: v
        for k, v in outcomes.items()
        if k not in ("200", "400", "disconnected", "gave up", "left early")
    }
    assert not failures, f"5xx, hangs or broken streams: {outcomes}"
    # Every kind happened, so the soak exercised what it claims to.
    assert all(outcomes[k] for k in ("200", "400", "disconnected", "gave up", "left early")), (
        outcomes
    )

    text = httpx.get(server.url + "/metrics", timeout=10).text
    wait_for_free_pages(server, metric(text, "gemma4serve:kv_cache_total_pages"))
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "gemma4serve:num_requests_running") == 0
    assert metric(text, "gemma4serve:num_requests_waiting") == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
