"""Hardening of the HTTP layer against the fake engine: the per-request limits (each a 400 naming
the field and its flag), bodies that are too large or not JSON, content parts a text-only server
cannot take, float settings the sampler's float32 cannot hold, and completion logprob offsets."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from test_server_fake import assert_openai_error, serve_fake

from gemma4serve.server import limits as server_limits
from gemma4serve.server.limits import RequestLimits
from gemma4serve.server.protocol import parse_request

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_model_len=200_000)


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine) as s:
        yield s


def post(server, path, body, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def test_two_million_stop_strings_get_a_400_and_others_are_served(server, engine):
    """The reproduction: n 4, max_tokens 16 and 2,000,000 short stop strings (a 20 MB body) once
    held the engine for 25 s. Now a 400 naming `stop`, and a small request sent meanwhile is
    served."""
    huge = {
        "prompt": "Once upon a time",
        "n": 4,
        "max_tokens": 16,
        "stop": [f"s{i}" for i in range(2_000_000)],
    }
    before = len(engine.requests)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                client.post(COMPLETIONS, json=huge),
                client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 16}),
            )

    refused, served = asyncio.run(run())
    error = assert_openai_error(refused, 400, param="stop", code="invalid_value")
    assert "--max-stop-sequences" in error["message"] and "2000000" in error["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["text"]
    assert len(engine.requests) == before + 1, "the refused request must not reach the engine"


def test_large_bodies_are_parsed_off_the_event_loop(server, monkeypatch):
    """A body past PARSE_IN_THREAD_BYTES is parsed in a worker thread: the event loop keeps
    serving others meanwhile."""
    threads = []

    def recording(request_type, body):
        threads.append((len(body), threading.current_thread()))
        return parse_request(request_type, body)

    monkeypatch.setattr(server_limits, "parse_request", recording)
    large = {"prompt": "x", "max_tokens": 1, "user": "u" * server_limits.PARSE_IN_THREAD_BYTES}
    for body in ({"prompt": "x", "max_tokens": 1}, large):
        assert post(server, COMPLETIONS, body).status_code == 200
    (small, small_thread), (big, big_thread) = threads
    assert small < server_limits.PARSE_IN_THREAD_BYTES < big
    assert small_thread is server.thread and big_thread is not server.thread


M = HI
LIMITS = [
    ("stop-count", CHAT, {"messages": M, "stop": ["x"] * 65}, "stop", "--max-stop-sequences"),
    ("stop-chars", CHAT, {"messages": M, "stop": ["x" * 4097]}, "stop", "--max-stop-chars"),
    (
        "stop-token-ids",
        CHAT,
        {"messages": M, "stop_token_ids": [5] * 65},
        "stop_token_ids",
        "--max-stop-sequences",
    ),
    (
        "bad-words-count",
        CHAT,
        {"messages": M, "bad_words": ["x"] * 65},
        "bad_words",
        "--max-stop-sequences",
    ),
    (
        "bad-words-chars",
        CHAT,
        {"messages": M, "bad_words": ["x" * 4097]},
        "bad_words",
        "--max-stop-chars",
    ),
    ("n", CHAT, {"messages": M, "n": 129}, "n", "--max-n"),
    (
        "batched-choices",
        COMPLETIONS,
        {"prompt": ["a"] * 9, "n": 128, "max_tokens": 1},
        "prompt",
        "--max-choices",
    ),
    ("batched-prompts", COMPLETIONS, {"prompt": [[10]] * 1025}, "prompt", "--max-choices"),
    (
        "messages",
        CHAT,
        {"messages": [{"role": "user", "content": "a"}] * 4097},
        "messages",
        "--max-messages",
    ),
]


@pytest.mark.parametrize(
    "path,body,param,flag", [c[1:] for c in LIMITS], ids=[c[0] for c in LIMITS]
)
def test_default_limits(server, engine, path, body, param, flag):
    before = len(engine.requests)
    error = assert_openai_error(post(server, path, body), 400, param=param, code="invalid_value")
    assert flag in error["message"]
    assert len(engine.requests) == before


def test_at_the_default_limits_requests_are_served(server):
    body = {
        "messages": [{"role": "user", "content": "a"}] * 4096,
        "stop": ["z" * 64] * 64,
        "stop_token_ids": [5] * 64,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 20,
    }
    assert post(server, CHAT, body).status_code == 200


def test_limits_are_configurable():
    limits = RequestLimits(
        max_request_body_bytes=2000,
        max_stop_sequences=1,
        max_stop_chars=3,
        max_n=2,
        max_messages=1,
    )
    with serve_fake(FakeEngine(), limits=limits) as s:
        ok = {"messages": HI, "max_tokens": 2, "stop": "abc", "n": 2, "logprobs": True}
        assert post(s, CHAT, {**ok, "top_logprobs": 1}).status_code == 200
        for change, param in [
            ({"stop": ["a", "b"]}, "stop"),
            ({"stop": "abcd"}, "stop"),
            ({"n": 3}, "n"),
            ({"messages": HI * 2}, "messages"),
        ]:
            assert_openai_error(post(s, CHAT, {**ok, **change}), 400, param=param)
        error = assert_openai_error(
            post(s, CHAT, {**ok, "user": "x" * 2000}), 413, code="request_too_large"
        )
        assert "--max-request-body-bytes" in error["message"]


def test_batched_prompts_times_n_is_bounded_by_max_choices():
    """A batched completion makes n engine sequences per prompt: len(prompt) x n is bounded by
    --max-choices (a 400 naming it, the engine untouched); at the bound it is served."""
    engine = FakeEngine()
    with serve_fake(engine, limits=RequestLimits(max_choices=6)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        served = client.completions.create(model="fake", prompt=["a", "b", "c"], n=2, max_tokens=2)
        assert sorted(c.index for c in served.choices) == list(range(6))
        before = len(engine.requests)
        for prompt, n, param in [(["a"] * 7, 1, "prompt"), (["a"] * 4, 2, "prompt"), ("a", 7, "n")]:
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="fake", prompt=prompt, n=n, max_tokens=2)
            error = refused.value.body
            assert refused.value.status_code == 400 and error["param"] == param
            assert (
                "--max-choices" in error["message"] and f"has {len(prompt) * n}" in error["message"]
            )
        assert len(engine.requests) == before


def test_token_id_lists_are_bounded_by_the_vocabulary():
    engine = FakeEngine()
    engine.tokenizer.vocab_size = 300
    with serve_fake(engine) as s:
        ok = {"messages": HI, "max_tokens": 2}
        for param, value in [
            ("logit_bias", {str(i % 300): 1.0 for i in range(300)}),
            ("allowed_token_ids", list(range(300))),
        ]:
            assert post(s, CHAT, {**ok, param: value}).status_code == 200
        error = assert_openai_error(
            post(s, CHAT, {**ok, "allowed_token_ids": [5] * 301}), 400, param="allowed_token_ids"
        )
        assert "vocabulary" in error["message"]
        big_bias = {str(i): 1.0 for i in range(301)}
        assert_openai_error(post(s, CHAT, {**ok, "logit_bias": big_bias}), 400, param="logit_bias")


def test_cli_flags_set_the_limits():
    from gemma4serve.cli import parse_args, request_limits

    ns = parse_args(
        ["--model", "m", "--max-request-body-bytes", "1MiB", "--max-stop-sequences", "8"]
        + ["--max-stop-chars", "100", "--max-n", "4", "--max-messages", "9"]
        + ["--max-choices", "16"]
    )
    assert request_limits(ns) == RequestLimits(
        max_request_body_bytes=1024 * 1024,
        max_stop_sequences=8,
        max_stop_chars=100,
        max_n=4,
        max_choices=16,
        max_messages=9,
    )
    assert request_limits(parse_args(["--model", "m"])) == RequestLimits()
    bad_flags = (["--max-n", "0"], ["--max-stop-chars", "-1"], ["--max-messages", "x"])
    for bad in (*bad_flags, ["--max-choices", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad])


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_non_json_content_types_get_415(server, engine, content_type):
    before = len(engine.requests)
    body = json.dumps({"messages": HI, "max_tokens": 2})
    r = httpx.post(server.url + CHAT, content=body, headers={"content-type": content_type})
    assert_openai_error(r, 415, code="unsupported_media_type")
    assert len(engine.requests) == before


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8"])
def test_json_bodies_are_taken_with_or_without_a_content_type(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    request = httpx.Request("POST", server.url + CHAT, content=body, headers=headers)
    assert request.headers.get("content-type") == content_type
    with httpx.Client() as client:
        assert client.send(request).status_code == 200


@pytest.mark.parametrize(
    "part,words",
    [
        (
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            ["'image_url'", "text-only"],
        ),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, ["'input_audio'"]),
        ({"type": "video_url", "video_url": {"url": "x"}}, ["'video_url'", "text-only"]),
        ({"type": "text"}, ["requires 'text'"]),
        ({"type": "text", "text": None}, ["requires 'text'"]),
    ],
)
def test_unsupported_content_parts_say_why(server, part, words):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    error = assert_openai_error(post(server, CHAT, body), 400, param="messages.0.content")
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize(
    "field,value",
    [("top_p", 1e-50), ("min_p", 1e-300), ("repetition_penalty", 5e-324), ("temperature", 1e-46)],
)
def test_values_float32_cannot_hold_get_a_400(server, field, value):
    error = assert_openai_error(
        post(server, CHAT, {"messages": HI, field: value}), 400, param=field
    )
    assert "float32" in error["message"]


def test_completion_text_offset_skips_special_tokens_left_out_of_the_text():
    engine = FakeEngine(reply="ab<|turn>cd")
    with serve_fake(engine) as s:
        body = {"prompt": "x", "max_tokens": 5, "logprobs": 0}
        choice = post(s, COMPLETIONS, body).json()["choices"][0]
        assert choice["text"] == "abcd"
        assert choice["logprobs"]["tokens"] == ["a", "b", "<|turn>", "c", "d"]
        assert choice["logprobs"]["text_offset"] == [0, 1, 2, 2, 3]
        streamed = [
            json.loads(line[len("data: ") :])
            for line in httpx.post(s.url + COMPLETIONS, json={**body, "stream": True}).text.split(
                "\n"
            )
            if line.startswith("data: {")
        ]
        offsets = [
            o
            for chunk in streamed
            for choice in chunk["choices"]
            if choice["logprobs"]
            for o in choice["logprobs"]["text_offset"]
        ]
        assert offsets == [0, 1, 2, 2, 3]
