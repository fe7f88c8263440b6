"""The real server.

`python -m gemma4serve.cli` as a subprocess on a loopback port, serving the tiny demo Gemma 4 with
its MTP assistant on CPU, talked to by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from fake_engine import (
    ServerProcess,
    free_pages,
    metric,
    sse_data,
    streamed_events,
    wait_for_free_pages,
)

pytestmark = [
    pytest.mark.timeout(300),
]

MODEL = "tiny"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Tell me a story about the sea."}]


def start_server(target, assistant, *extra: str) -> ServerProcess:
    return ServerProcess(
        [
            "-m",
            "gemma4serve.cli",
            "--model",
            str(target),
            "--draft",
            str(assistant),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "1024",
            "--num-draft-tokens",
            "3",
            "--disable-uvicorn-access-log",
            *extra,
        ],
        ready_timeout=240,
    )


@pytest.fixture(scope="module")
def server(demo_root):
    _, target, assistant = demo_root
    with start_server(target, assistant) as proc:
        yield proc


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_ready_line_health_and_models(server, client):
    assert len(server.ready_lines()) == 1
    assert server.ready_lines()[0] == f"gemma4serve ready: {server.url} (model {MODEL})"
    assert not any("Uvicorn running on" in line for line in server.lines)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == [full.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    u = full.usage
    assert (
        u.total_tokens == u.prompt_tokens + u.completion_tokens and 1 <= u.completion_tokens <= 40
    )


def test_greedy_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0)
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == full.choices[0].text


def test_usage_adds_up_over_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, n=3, seed=1, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 36
    assert r.usage.total_tokens == r.usage.prompt_tokens + 36
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=12,
            n=3,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_logprobs_shapes(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    r = client.completions.create(
        model=MODEL, prompt="a", max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )


@pytest.mark.parametrize(
    "path,body,status",
    [
        (CHAT, b'{"messages": [', 400),
        (CHAT, {"model": "gpt-4o", "messages": HI}, 404),
        (CHAT, {"messages": []}, 400),
        (CHAT, {"messages": [{"role": "user", "content": "word " * 1200}]}, 400),
        (CHAT, {"messages": HI, "max_tokens": 5000}, 400),
        (CHAT, {"messages": HI, "temperature": -1}, 400),
        ("/v1/completions", {"prompt": [5, 512]}, 400),  # the demo vocab has 512 ids
        ("/v1/completions", {"prompt": ["a", [5, 512]]}, 400),
        (
            CHAT,
            {"messages": HI, "top_k": 2**40},
            400,
        ),  # would overflow the sampler's int32 and fail the batch
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),  # not encodable
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', 400),
    ],
)
def test_bad_requests(server, path, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        server.url + path, headers={"content-type": "application/json"}, timeout=30, **kwargs
    )
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_disconnect_mid_stream_returns_kv_pages(server):
    baseline = free_pages(server)
    body = {"model": MODEL, "messages": HI, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        held = free_pages(server)
        assert held < baseline, "the stream should hold KV pages while it runs"
    wait_for_free_pages(server, baseline)


def test_request_success_counts_requests_not_choices(server, client):
    """One chat request of 3 choices is one finished request in /metrics, under its reason."""

    def finished() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return metric(text, "gemma4serve:request_success_total", finished_reason="length")

    before = finished()
    response = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.finish_reason for c in response.choices] == ["length"] * 3
    assert finished() - before == 1


def test_spec_decode_metrics_move(server, client):
    before = httpx.get(server.url + "/metrics").text
    response = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=20, extra_body={"ignore_eos": True}
    )
    after = httpx.get(server.url + "/metrics").text

    def delta(name: str) -> float:
        # A labelled histogram has no series before its first observation (this test alone).
        start = metric(before, "gemma4serve:" + name) if name in before else 0.0
        return metric(after, "gemma4serve:" + name) - start

    assert delta("spec_decode_num_drafts_total") > 0  # the drafter is on
    assert (
        metric(after, "gemma4serve:spec_decode_draft_length") == 3
    )  # no step costs on CPU: k stays fixed
    assert delta("spec_decode_num_draft_tokens_total") > 0
    assert delta("generation_tokens_total") >= 20
    assert delta("e2e_request_latency_seconds_count") == 1
    # Steps by their tokens: the prompt's rows, then one verify step per draft round at least.
    steps = delta("iteration_tokens_total_count")
    assert steps > delta("spec_decode_num_drafts_total")
    assert delta("iteration_tokens_total_sum") >= response.usage.prompt_tokens + steps - 1
    assert metric(after, "gemma4serve:iteration_tokens_total_bucket", le="+Inf") == metric(
        after, "gemma4serve:iteration_tokens_total_count"
    )


def test_100_concurrent_streams(server):
    baseline = free_pages(server)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=16,
            stream=True,
        )
        text, finish = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def run():
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=128), timeout=120)
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", http_client=http, max_retries=0
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(100))), 240)

    results = asyncio.run(run())
    assert len(results) == 100 and all(finish in ("stop", "length") for _, finish in results)
    wait_for_free_pages(server, baseline)


def test_demo_flag_and_sigterm_exits_0(demo_root):
    root, _, _ = demo_root
    proc = ServerProcess(
        [
            "-m",
            "gemma4serve.cli",
            "--demo",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--drain-timeout",
            "120",  # outlasts the 60 tokens even on a loaded 2-core machine
        ],
        ready_timeout=240,
        env={"GEMMA4SERVE_CACHE": str(root)},
    )
    with proc:
        assert proc.ready_lines()[0].endswith("(model gemma4serve-demo)")
        # where the README says --demo keeps its model
        where = f"serving {root / 'demo-v1' / 'target'} with its assistant {root / 'demo-v1'}"
        assert any(where in line for line in proc.lines), proc.lines
        body = {
            "model": "gemma4serve-demo",
            "messages": HI,
            "max_tokens": 60,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", proc.url + CHAT, json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.signal(signal.SIGTERM)
            payloads = sse_data([first, *lines])  # the running stream finishes
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(150) == 0


def test_a_port_in_use_fails_before_the_engine_starts(demo_root):
    """The listening socket is bound first: a taken port ends the server in seconds with one clear
    line and exit 1, before any model is prepared or loaded."""
    root, _, _ = demo_root
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "gemma4serve.cli", "--demo", "--device", "cpu"]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "GEMMA4SERVE_CACHE": str(root)}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out, out
    assert "--demo: preparing" not in out and "engine process started" not in out, out


def test_prefix_cache_hit_is_reported(server, client):
    """The same conversation twice: the second is served from the prefix cache, says so in
    usage.prompt_tokens_details.cached_tokens and the prefix-cache counters, and answers alike."""
    messages = [
        {"role": "system", "content": "You are a careful assistant. " * 30},
        {"role": "user", "content": "Name three colours of the sea."},
    ]
    before = httpx.get(server.url + "/metrics").text
    first, second = (
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0.0
        )
        for _ in range(2)
    )
    after = httpx.get(server.url + "/metrics").text
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    hits = metric(after, "gemma4serve:prefix_cache_hits_total") - metric(
        before, "gemma4serve:prefix_cache_hits_total"
    )
    assert hits == second.usage.prompt_tokens_details.cached_tokens
    queries = metric(after, "gemma4serve:prefix_cache_queries_total") - metric(
        before, "gemma4serve:prefix_cache_queries_total"
    )
    assert queries == 2 * second.usage.prompt_tokens


def test_cache_salt_keeps_tenants_apart(server):
    """vLLM's cache_salt: a request hits the prefix cache only through requests of its salt."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Salted prompt. " * 40}],
        "max_tokens": 4,
        "temperature": 0.0,
    }

    def cached(**salt) -> int:
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **salt}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0
    assert cached(cache_salt="tenant-a") > 0 and cached() > 0
    for bad in ("", "a/b", "x" * 129):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_completion_returns_token_ids(server):
    """vLLM's `return_token_ids`: the prompt's and the output's ids, streamed and not."""
    body = {"model": MODEL, "prompt": [2, 300, 301, 302], "max_tokens": 6, "temperature": 0.0}
    r = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [2, 300, 301, 302]
    assert len(choice["token_ids"]) == r.json()["usage"]["completion_tokens"] > 0
    events = streamed_events(
        server.url + "/v1/completions", {**body, "return_token_ids": True, "stream": True}
    )
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" not in plain


def test_model_without_tokenizer_serves_token_ids(demo_root, tmp_path):
    """Checkpoints made of configs alone (the GPU benchmarks' dummy weights) have no tokenizer:
    token-id prompts are served, text prompts and chat get a clear 400."""
    import shutil

    _, target, assistant = demo_root
    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    (bare / "tokenizer.json").unlink()
    with start_server(bare, assistant) as proc:
        body = {"model": MODEL, "prompt": [2, 300, 301], "max_tokens": 4, "return_token_ids": True}
        r = httpx.post(proc.url + "/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        outside = httpx.post(proc.url + "/v1/completions", json={**body, "prompt": [2, 10**6]})
        assert outside.status_code == 400 and "vocabulary" in outside.json()["error"]["message"]
        for path, request in [
            ("/v1/completions", {**body, "prompt": "hello"}),
            (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4}),
        ]:
            refused = httpx.post(proc.url + path, json=request)
            assert refused.status_code == 400
            assert "no tokenizer" in refused.json()["error"]["message"]
