"""The HTTP layer against the fake engine.

The official `openai` client and raw HTTP on a loopback port, streamed and not, every refusal in
OpenAI's error schema, auth, health, metrics, disconnects, concurrency, SIGTERM draining, and the
CLI's argument handling. Fast: no weights."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from fake_engine import (
    REPLY,
    REPO_ROOT,
    FakeEngine,
    ServerProcess,
    metric,
    sse_data,
    streamed_events,
    wait_until,
)

from gemma4serve.server.app import build_app
from gemma4serve.server.settings import CorsSettings, ServerSettings

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


class ThreadServer:
    """uvicorn serving `app` in a thread of this process, on 127.0.0.1 and a free port."""

    def __init__(self, app):
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), (
                "test server did not start"
            )
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "test server did not stop"


def serve_fake(engine: FakeEngine, **settings) -> ThreadServer:
    """The app over `engine` in a thread; `settings` are ServerSettings' fields."""
    settings.setdefault("served_model_names", ["fake", "fake-alias"])
    return ThreadServer(build_app(engine, ServerSettings(**settings)))


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def assert_openai_error(response: httpx.Response, status: int, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


# --------------------------------------------------------------------------------------------------
# Happy paths through the official client


def test_models(server, client):
    assert [m.id for m in client.models.list().data] == ["fake", "fake-alias"]
    card = httpx.get(server.url + "/v1/models/fake").json()
    assert (
        card["object"] == "model"
        and card["max_model_len"] == 256
        and card["root"] == "fake/gemma-4-fake"
    )
    assert_openai_error(
        httpx.get(server.url + "/v1/models/nope"), 404, param="model", code="model_not_found"
    )


def test_chat_non_streaming(client, engine):
    r = client.chat.completions.create(model="fake", messages=HI, max_tokens=100)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "fake"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == REPLY
    assert choice.finish_reason == "stop"
    prompt_ids, _ = engine.requests[r.id]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(REPLY) + 1  # + <eos>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_alias_and_missing_model(server, client):
    assert (
        client.chat.completions.create(model="fake-alias", messages=HI, max_tokens=3).model
        == "fake-alias"
    )
    r = httpx.post(
        server.url + CHAT, json={"messages": HI, "max_tokens": 3}
    )  # vLLM accepts no "model"
    assert r.status_code == 200 and r.json()["model"] == "fake"


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model="fake", messages=HI, max_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=HI,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == REPLY[:30]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_wire_format(server):
    body = {"model": "fake", "messages": HI, "max_tokens": 6, "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("chatcmpl-")
        payloads = sse_data(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and set(c) == {
            "id",
            "object",
            "created",
            "model",
            "choices",
        }
    assert (
        chunks[-1]["choices"][0]["delta"] == {}
        and chunks[-1]["choices"][0]["finish_reason"] == "length"
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:6]


def test_completions(client, engine):
    r = client.completions.create(model="fake", prompt="Once", max_tokens=9)
    assert (
        r.object == "text_completion"
        and r.choices[0].text == REPLY[:9]
        and r.choices[0].finish_reason == "length"
    )
    prompt_ids, _ = engine.requests[r.id]
    assert (
        prompt_ids[0] == engine.tokenizer.bos_token_id
    )  # <bos> prepended, as HF/vLLM do for a text prompt
    assert r.usage.prompt_tokens == len(prompt_ids) == 5 and r.usage.completion_tokens == 9

    chunks = list(client.completions.create(model="fake", prompt="Once", max_tokens=9, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY[:9]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_token_ids_echo_and_no_bos(server, client, engine):
    ids = engine.tokenizer.encode("Hey")
    r = client.completions.create(model="fake", prompt=ids, max_tokens=4, echo=True)
    assert engine.requests[r.id][0] == ids and r.choices[0].text == "Hey" + REPLY[:4]
    r = httpx.post(
        server.url + COMPLETIONS,
        json={"prompt": "Hey", "max_tokens": 2, "add_special_tokens": False},
    )
    assert engine.requests[r.json()["id"]][0] == ids
    chunks = list(
        client.completions.create(model="fake", prompt="Hey", max_tokens=3, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "Hey" + REPLY[:3]


def test_n_choices_usage_adds_up(client):
    r = client.chat.completions.create(model="fake", messages=HI, max_tokens=7, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content == REPLY[:7] for c in r.choices)
    assert r.usage.completion_tokens == 21 and r.usage.total_tokens == r.usage.prompt_tokens + 21

    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=HI,
            max_tokens=7,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == REPLY[:7]
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 21

    r = client.completions.create(model="fake", prompt="x", max_tokens=5, n=2)
    assert r.usage.completion_tokens == 10


def test_stop_strings_and_stop_token_ids(client, engine):
    r = client.chat.completions.create(model="fake", messages=HI, stop=["fox"], max_tokens=100)
    assert (
        r.choices[0].message.content == "The quick brown " and r.choices[0].finish_reason == "stop"
    )
    assert r.choices[0].model_extra["stop_reason"] == "fox"
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="fake", messages=HI, stop="fox", max_tokens=100, stream=True
        )
        if c.choices
    )
    assert text == "The quick brown "
    r = client.completions.create(
        model="fake",
        prompt="x",
        max_tokens=50,
        extra_body={"stop_token_ids": [engine.tokenizer.encode("q")[0]]},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == "The "


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="fake", messages=HI, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == list(REPLY[:4])
    for t in content:
        assert t.logprob == -0.25 and t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token
    streamed = [
        lp
        for c in client.chat.completions.create(
            model="fake", messages=HI, max_tokens=4, logprobs=True, top_logprobs=2, stream=True
        )
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    assert (
        client.chat.completions.create(model="fake", messages=HI, max_tokens=2).choices[0].logprobs
        is None
    )


def test_return_tokens_as_token_ids_flag_is_each_request_s_default():
    engine = FakeEngine()
    with serve_fake(engine, return_tokens_as_token_ids=True) as s:
        body = {"messages": HI, "max_tokens": 3, "logprobs": True}

        def tokens(**extra) -> list[str]:
            r = httpx.post(s.url + CHAT, json=body | extra, timeout=20)
            assert r.status_code == 200, r.text
            return [entry["token"] for entry in r.json()["choices"][0]["logprobs"]["content"]]

        ids = [f"token_id:{t}" for t in engine.tokenizer.encode(REPLY[:3])]
        assert tokens() == tokens(return_tokens_as_token_ids=True) == ids
        assert tokens(return_tokens_as_token_ids=False) == list(REPLY[:3])


def test_completion_logprobs(client):
    r = client.completions.create(model="fake", prompt="x", max_tokens=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == list(REPLY[:5]) and lp.token_logprobs == [-0.25] * 5
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert all(list(top) == [tok] for top, tok in zip(lp.top_logprobs, lp.tokens))
    chunks = list(
        client.completions.create(model="fake", prompt="x", max_tokens=5, logprobs=1, stream=True)
    )
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == [0, 1, 2, 3, 4]


def test_sampling_params_reach_the_engine(client, engine):
    r = client.chat.completions.create(
        model="fake",
        messages=HI,
        max_completion_tokens=5,
        max_tokens=50,
        temperature=0,
        top_p=0.5,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={"top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    _, p = engine.requests[r.id]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        5,
        0.0,
        0.5,
        40,
        0.1,
        7,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.ignore_eos) == (
        0.5,
        -0.5,
        1.2,
        True,
    )
    r = client.chat.completions.create(
        model="fake", messages=HI
    )  # no max_tokens: the rest of the context
    prompt_ids, p = engine.requests[r.id]
    assert p.max_tokens == engine.max_model_len - len(prompt_ids) and p.temperature == 1.0


def test_engine_sampling_defaults_fill_unset_fields():
    engine = FakeEngine()
    engine.default_sampling_params = {
        "temperature": 0.7,
        "top_k": 64,
        "top_p": 0.95,
    }  # a generation_config
    with serve_fake(engine) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        _, p = engine.requests[
            c.chat.completions.create(model="fake", messages=HI, max_tokens=2).id
        ]
        assert (p.temperature, p.top_k, p.top_p) == (0.7, 64, 0.95)
        _, p = engine.requests[
            c.chat.completions.create(model="fake", messages=HI, max_tokens=2, temperature=0).id
        ]
        assert (p.temperature, p.top_k, p.top_p) == (0.0, 64, 0.95)


def test_unknown_fields_ignored_nulls_accepted(server):
    """OpenAI's optional fields are nullable; vLLM takes a null as the field left out."""
    body = {
        "model": "fake",
        "messages": HI,
        "max_tokens": None,
        "temperature": None,
        "stop": None,
        "some_future_field": {"x": 1},
        "metadata": {"a": "b"},
        "store": False,
        "chat_template_kwargs": {"enable_thinking": True},
        "tools": [],
        "tool_choice": "auto",
        # fields whose default is not null
        "n": None,
        "stream": None,
        "stream_options": None,
        "logprobs": None,
        "skip_special_tokens": None,
        "ignore_eos": None,
        "min_tokens": None,
        "add_generation_prompt": None,
    }
    r = httpx.post(server.url + CHAT, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    # a completion's max_tokens left out or null is OpenAI's legacy 16, as in vLLM
    for max_tokens in ({}, {"max_tokens": None}):
        body = {"prompt": "Once", "ignore_eos": True, "echo": None, **max_tokens}
        r = httpx.post(server.url + COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16


def test_an_assistant_turn_may_be_empty(server, engine):
    """A refusal or a reasoning-only turn replayed has no content; other roles need theirs."""
    messages = [*HI, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    r = httpx.post(server.url + CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "again" in engine.tokenizer.decode(engine.requests[r.json()["id"]][0])
    empty_user = [{"role": "user", "content": None}]
    assert_openai_error(httpx.post(server.url + CHAT, json={"messages": empty_user}), 400)


def test_reasoning_effort_turns_thinking_on_as_in_vllm():
    """OpenAI's reasoning_effort, as vLLM maps it for Gemma 4: thinking on, off for "none"; the
    request's own enable_thinking wins over it, and it wins over the server's default."""
    for default, effort, kwargs, thinks in (
        ({}, "high", None, True),
        ({}, "low", None, True),
        ({}, "none", None, False),
        ({}, "high", {"enable_thinking": False}, False),
        ({}, None, None, False),
        ({"enable_thinking": True}, "none", None, False),
        ({"enable_thinking": True}, None, None, True),
    ):
        engine = FakeEngine()
        with serve_fake(engine, default_chat_template_kwargs=default) as server:
            body = {"messages": HI, "reasoning_effort": effort, "chat_template_kwargs": kwargs}
            r = httpx.post(server.url + CHAT, json=body)
            assert r.status_code == 200, r.text
            prompt_ids, _ = engine.requests[r.json()["id"]]
            assert ("<|think|>" in engine.tokenizer.decode(prompt_ids)) == thinks, body
    with serve_fake(FakeEngine()) as server:
        bad = httpx.post(server.url + CHAT, json={"messages": HI, "reasoning_effort": "big"})
        assert_openai_error(bad, 400, param="reasoning_effort")


def test_chat_returns_token_ids(server, engine):
    """vLLM's return_token_ids on chat: the prompt's ids at the top of the body (of the first
    chunk when streamed), each choice's ids in it (each chunk's new ones when streamed)."""
    body = {"messages": HI, "max_tokens": 12, "return_token_ids": True}
    r = httpx.post(server.url + CHAT, json=body).json()
    prompt_ids, _ = engine.requests[r["id"]]
    assert r["prompt_token_ids"] == prompt_ids
    choice = r["choices"][0]
    assert choice["token_ids"] == engine.tokenizer.encode(REPLY[:12])
    events = streamed_events(server.url + CHAT, {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in event for event in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    plain = httpx.post(server.url + CHAT, json={"messages": HI, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completion_stream_sends_prompt_token_ids_first(server, engine):
    """vLLM: with return_token_ids each choice's first streamed chunk carries its prompt's ids."""
    body = {"prompt": ["Once", "Hey"], "max_tokens": 3, "n": 2, "return_token_ids": True}
    events = streamed_events(server.url + COMPLETIONS, {**body, "stream": True})
    firsts = {}
    for event in events:
        for choice in event["choices"]:
            firsts.setdefault(choice["index"], choice)
            if choice is not firsts[choice["index"]]:
                assert "prompt_token_ids" not in choice
    bos = engine.tokenizer.bos_token_id
    for index, choice in firsts.items():
        text = body["prompt"][index // 2]
        assert choice["prompt_token_ids"] == [bos, *engine.tokenizer.encode(text)]


def test_truncation_side_and_seed_minus_one(server, engine):
    """vLLM's truncation_side "right" keeps a prompt's first tokens; seed -1 is no seed."""
    ids = engine.tokenizer.encode("abcdef")
    for side, kept in ((None, ids[-2:]), ("left", ids[-2:]), ("right", ids[:2])):
        body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 2}
        r = httpx.post(server.url + COMPLETIONS, json={**body, "truncation_side": side})
        assert engine.requests[r.json()["id"]][0] == kept, side
    for seed, given in ((-1, None), (5, 5)):
        r = httpx.post(server.url + CHAT, json={"messages": HI, "max_tokens": 1, "seed": seed})
        assert engine.requests[r.json()["id"]][1].seed == given


@pytest.mark.parametrize(
    "field, value",
    [
        ("thinking_token_budget", 64),
        ("logprob_token_ids", [1, 2]),
        ("use_beam_search", True),
        ("repetition_detection", {"max_pattern_size": 4}),
    ],
)
def test_vllm_features_this_server_lacks_are_refused(server, field, value):
    """Refused with a 400 that names them, never silently ignored."""
    for path, body in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "Once"})):
        r = httpx.post(server.url + path, json={**body, field: value})
        assert_openai_error(r, 400, param=field)
    # values that ask for nothing pass, as vLLM takes them for "off"
    for off in (
        {"use_beam_search": False},
        {"thinking_token_budget": -1},
        {"logprob_token_ids": []},
        {"repetition_detection": {"max_pattern_size": 0}},
    ):
        assert httpx.post(server.url + CHAT, json={"messages": HI, **off}).is_success, off


def test_tool_choice_none_renders_the_tools_unless_told_not_to():
    """vLLM: the tools stay in the prompt under tool_choice "none", unless the server runs with
    --exclude-tools-when-tool-choice-none."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    for exclude, choice, rendered in (
        (False, "none", True),
        (True, "none", False),
        (True, "auto", True),
    ):
        engine = FakeEngine()
        with serve_fake(engine, exclude_tools_when_tool_choice_none=exclude) as server:
            body = {"model": "fake", "messages": HI, "tools": tools, "tool_choice": choice}
            r = httpx.post(server.url + CHAT, json=body)
            assert r.status_code == 200, r.text
            prompt_ids, _ = engine.requests[r.json()["id"]]
            assert ("tools: f" in engine.tokenizer.decode(prompt_ids)) == rendered


def test_default_chat_template_kwargs_sit_under_the_requests_own():
    """vLLM's --default-chat-template-kwargs: every chat prompt (and /tokenize's) renders with
    them unless the request's chat_template_kwargs say otherwise."""
    engine = FakeEngine()
    with serve_fake(engine, default_chat_template_kwargs={"enable_thinking": True}) as server:
        for kwargs, thinks in ((None, True), ({"enable_thinking": False}, False), ({}, True)):
            body = {"model": "fake", "messages": HI, "chat_template_kwargs": kwargs}
            r = httpx.post(server.url + CHAT, json=body)
            assert r.status_code == 200, r.text
            prompt_ids, _ = engine.requests[r.json()["id"]]
            assert ("<|think|>" in engine.tokenizer.decode(prompt_ids)) == thinks, kwargs
            r = httpx.post(server.url + "/tokenize", json=body)
            assert r.status_code == 200, r.text
            assert ("<|think|>" in engine.tokenizer.decode(r.json()["tokens"])) == thinks


def test_multipart_text_content_and_tool_messages(client):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert (
        client.chat.completions.create(model="fake", messages=messages, max_tokens=2)
        .choices[0]
        .message.content
    )


def test_templating_runs_off_the_event_loop(server, client, engine):
    client.chat.completions.create(model="fake", messages=HI, max_tokens=1)
    assert engine.tokenizer.template_threads
    assert all(t is not server.thread for t in engine.tokenizer.template_threads)


# --------------------------------------------------------------------------------------------------
# Every refusal: its status and OpenAI's error body

M = HI
BAD_REQUESTS = [
    # (id, path, body, status, param)
    ("malformed-json", CHAT, b'{"model": "fake", "messages": [', 400, None),
    ("not-an-object", CHAT, b"[1, 2]", 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("missing-messages", CHAT, {"model": "fake"}, 400, "messages"),
    ("messages-not-list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (
        "content-wrong-type",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    (
        "image-part",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "messages.0.content",
    ),
    ("user-without-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("max-tokens-string", CHAT, {"messages": M, "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-float", CHAT, {"messages": M, "max_tokens": 1.5}, 400, "max_tokens"),
    ("temperature-string", CHAT, {"messages": M, "temperature": "hot"}, 400, "temperature"),
    ("stream-string", CHAT, {"messages": M, "stream": "yes"}, 400, "stream"),
    ("n-string", CHAT, {"messages": M, "n": "2"}, 400, "n"),
    ("stop-number", CHAT, {"messages": M, "stop": 5}, 400, "stop"),
    ("seed-float", CHAT, {"messages": M, "seed": 1.5}, 400, "seed"),
    ("chat-logprobs-int", CHAT, {"messages": M, "logprobs": 5}, 400, "logprobs"),
    (
        "top-logprobs-without-logprobs",
        CHAT,
        {"messages": M, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "top-logprobs-too-many",
        CHAT,
        {"messages": M, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("max-tokens-zero", CHAT, {"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", CHAT, {"messages": M, "max_tokens": -1}, 400, "max_tokens"),
    (
        "max-completion-tokens-zero",
        CHAT,
        {"messages": M, "max_completion_tokens": 0},
        400,
        "max_tokens",
    ),
    ("temperature-negative", CHAT, {"messages": M, "temperature": -1}, 400, "temperature"),
    ("top-p-zero", CHAT, {"messages": M, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", CHAT, {"messages": M, "top_p": 1.5}, 400, "top_p"),
    ("top-k-below-minus-one", CHAT, {"messages": M, "top_k": -2}, 400, "top_k"),
    ("min-p-above-one", CHAT, {"messages": M, "min_p": 2}, 400, "min_p"),
    (
        "presence-penalty-range",
        CHAT,
        {"messages": M, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        "frequency-penalty-range",
        CHAT,
        {"messages": M, "frequency_penalty": -3},
        400,
        "frequency_penalty",
    ),
    (
        "repetition-penalty-zero",
        CHAT,
        {"messages": M, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("n-zero", CHAT, {"messages": M, "n": 0}, 400, "n"),
    (
        "stream-options-without-stream",
        CHAT,
        {"messages": M, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("logit-bias-not-a-token", CHAT, {"messages": M, "logit_bias": {"x": 5}}, 400, "logit_bias"),
    (
        "response-format-unknown",
        CHAT,
        {"messages": M, "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    ("empty-stop-string", CHAT, {"messages": M, "stop": [""]}, 400, "stop"),
    ("over-context", CHAT, {"messages": M, "max_tokens": 250}, 400, "max_tokens"),
    (
        "prompt-too-long",
        CHAT,
        {"messages": [{"role": "user", "content": "x" * 300}]},
        400,
        "messages",
    ),
    (
        "template-kwargs-reserved",
        CHAT,
        {"messages": M, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    (
        "template-kwargs-wrong-type",
        CHAT,
        {"messages": M, "chat_template_kwargs": "x"},
        400,
        "chat_template_kwargs",
    ),
    (
        "template-raises",
        CHAT,
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        400,
        "messages",
    ),
    ("unknown-model", CHAT, {"model": "gpt-4o", "messages": M}, 404, "model"),
    (
        "nan-literal",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        None,
    ),
    (
        "infinite-number",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
        400,
        "temperature",
    ),
    ("deep-nesting", CHAT, b"[" * 200_000, 400, None),
    ("top-k-beyond-int32", CHAT, {"messages": M, "top_k": 2**40}, 400, "top_k"),
    ("seed-beyond-int64", CHAT, {"messages": M, "seed": 2**63}, 400, "seed"),
    (
        "stop-token-beyond-int64",
        COMPLETIONS,
        {"prompt": "a", "stop_token_ids": [2**64]},
        400,
        "stop_token_ids",
    ),
    (
        "allowed-token-beyond-int64",
        COMPLETIONS,
        {"prompt": "a", "allowed_token_ids": [2**64]},
        400,
        "allowed_token_ids",
    ),
    (
        "logit-bias-beyond-int64",
        CHAT,
        {"messages": M, "logit_bias": {str(2**70): 1}},
        400,
        "logit_bias",
    ),
    ("guided-choice-empty", CHAT, {"messages": M, "guided_choice": []}, 400, "guided_choice"),
    ("guided-choice-ints", CHAT, {"messages": M, "guided_choice": [1]}, 400, "guided_choice"),
    ("guided-regex-list", COMPLETIONS, {"prompt": "a", "guided_regex": ["a"]}, 400, "guided_regex"),
    (
        "structured-grammar-empty",
        CHAT,
        {"messages": M, "structured_outputs": {"grammar": ""}},
        400,
        "structured_outputs",
    ),
    (
        "two-constraints",
        COMPLETIONS,
        {"prompt": "a", "guided_regex": "a+", "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "two-structured-kinds",
        COMPLETIONS,
        {"prompt": "a", "structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    (
        "forced-tool-and-choice",
        CHAT,
        {
            "messages": M,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "guided_choice": ["a"],
        },
        400,
        "guided_choice",
    ),
    (
        "choice-lone-surrogate",
        COMPLETIONS,
        b'{"prompt": "a", "guided_choice": ["\\udfff"]}',
        400,
        "guided_choice",
    ),
    (
        "structured-unknown",
        CHAT,
        {"messages": M, "structured_outputs": {"structural_tag": "x"}},
        400,
        "structured_outputs",
    ),
    ("n-too-many", CHAT, {"messages": M, "n": 129}, 400, "n"),
    (
        "lone-surrogate",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages",
    ),
    (
        "lone-surrogate-model",
        CHAT,
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "model",
    ),
    ("completion-lone-surrogate", COMPLETIONS, b'{"prompt": "\\udfff"}', 400, "prompt"),
    ("completion-missing-prompt", COMPLETIONS, {"model": "fake"}, 400, "prompt"),
    ("completion-prompt-number", COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    ("completion-batch-empty-prompt", COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt"),
    (
        "completion-token-batch-beyond-vocab",
        COMPLETIONS,
        {"prompt": [[10], [10**9]]},
        400,
        "prompt",
    ),
    ("completion-batch-too-large", COMPLETIONS, {"prompt": ["a"] * 1025}, 400, "prompt"),
    ("completion-empty-string", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("completion-empty-list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("completion-negative-token", COMPLETIONS, {"prompt": [10, -1]}, 400, "prompt"),
    ("completion-token-beyond-vocab", COMPLETIONS, {"prompt": [10, 10**9]}, 400, "prompt"),
    ("completion-tokens-too-long", COMPLETIONS, {"prompt": [10] * 300}, 400, "prompt"),
    ("completion-logprobs-bool", COMPLETIONS, {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ("completion-logprobs-range", COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("completion-suffix", COMPLETIONS, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("completion-best-of", COMPLETIONS, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("completion-unknown-model", COMPLETIONS, {"model": "nope", "prompt": "a"}, 404, "model"),
]


@pytest.mark.parametrize(
    "path,body,status,param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request(server, engine, path, body, status, param):
    before = len(engine.requests)
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        server.url + path, headers={"content-type": "application/json"}, timeout=10, **kwargs
    )
    error = assert_openai_error(r, status, param=param)
    if status == 404:
        assert error["code"] == "model_not_found"
    assert len(engine.requests) == before, "a refused request must not reach the engine"


def test_top_logprobs_zero_without_logprobs_is_fine(server):
    assert (
        httpx.post(
            server.url + CHAT, json={"messages": M, "max_tokens": 2, "top_logprobs": 0}
        ).status_code
        == 200
    )


def test_context_errors_have_openai_code(server):
    r = httpx.post(server.url + CHAT, json={"messages": M, "max_tokens": 250})
    assert_openai_error(r, 400, code="context_length_exceeded")


def test_body_too_large(server):
    r = httpx.post(
        server.url + CHAT,
        content=b"x" * (33 * 1024 * 1024),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 413)


def test_unknown_route_and_wrong_method(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + CHAT), 405)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=HI, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=[])


def test_engine_value_error_is_a_400():
    class Refusing(FakeEngine):
        async def generate(self, prompt_token_ids, params, request_id):
            raise ValueError("the engine says no")
            yield  # an async generator, like the real one

    refusing = Refusing()
    with serve_fake(refusing) as s:
        error = assert_openai_error(
            httpx.post(s.url + CHAT, json={"messages": HI, "stream": True}), 400
        )
        assert error["message"] == "the engine says no"
        assert_openai_error(httpx.post(s.url + COMPLETIONS, json={"prompt": "a"}), 400)


def test_engine_failure_is_reported_not_hung():
    with serve_fake(FakeEngine(fail_after_steps=2)) as s:
        assert_openai_error(httpx.post(s.url + CHAT, json={"messages": HI, "max_tokens": 50}), 500)
        with httpx.stream(
            "POST", s.url + CHAT, json={"messages": HI, "max_tokens": 50, "stream": True}
        ) as r:
            payloads = sse_data(r.iter_lines())
        assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])
        assert httpx.get(s.url + "/health").status_code == 200  # the server itself survives


def test_engine_stopping_short_ends_the_stream_as_abort():
    class StopsShort(FakeEngine):
        async def generate(self, prompt_token_ids, params, request_id):
            async for output in super().generate(prompt_token_ids, params, request_id):
                yield output
                return  # one unfinished output, then nothing

    with serve_fake(StopsShort()) as s:
        with httpx.stream(
            "POST", s.url + CHAT, json={"messages": HI, "max_tokens": 50, "stream": True}
        ) as r:
            payloads = sse_data(r.iter_lines())
        assert (
            payloads[-1] == "[DONE]"
            and json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort"
        )
        body = httpx.post(s.url + CHAT, json={"messages": HI, "max_tokens": 50}).json()
        assert (
            body["choices"][0]["finish_reason"] == "abort"
            and body["choices"][0]["message"]["content"] == "Th"
        )


# --------------------------------------------------------------------------------------------------
# Auth, health, lifecycle


def test_api_key():
    with serve_fake(FakeEngine(), api_keys=["sekret", "other"]) as s:
        assert_openai_error(
            httpx.post(s.url + CHAT, json={"messages": HI}), 401, code="invalid_api_key"
        )
        bad = httpx.post(
            s.url + CHAT, json={"messages": HI}, headers={"Authorization": "Bearer nope"}
        )
        assert_openai_error(bad, 401, code="invalid_api_key")
        assert_openai_error(httpx.get(s.url + "/v1/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        for key in ("sekret", "other"):  # vLLM's --api-key takes several
            good = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            assert good.chat.completions.create(model="fake", messages=HI, max_tokens=2).choices
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_cors_is_off_unless_origins_are_given():
    """vLLM 0.33's default: no web page may make a visitor's browser call the server."""
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST"}
    with serve_fake(FakeEngine()) as s:
        r = httpx.options(s.url + CHAT, headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://page.example"})
        assert r.is_success and "access-control-allow-origin" not in r.headers
    with serve_fake(FakeEngine(), cors=CorsSettings(allowed_origins=["*"])) as s:
        r = httpx.options(s.url + CHAT, headers=preflight)
        assert r.is_success and r.headers["access-control-allow-origin"] == "*"


def test_health_lifecycle_and_draining():
    engine = FakeEngine()
    app = build_app(engine, ServerSettings(["fake"], drain_timeout=7.0))
    state = app.state.gemma4serve
    assert not engine.started and not state.ready
    with ThreadServer(app) as s:
        assert engine.started
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        assert httpx.get(s.url + "/ping").is_success and httpx.post(s.url + "/ping").is_success
        state.begin_drain()
        assert_openai_error(httpx.get(s.url + "/health"), 503)
        assert_openai_error(httpx.get(s.url + "/ping"), 503)
        assert_openai_error(httpx.post(s.url + CHAT, json={"messages": HI}), 503)
        assert httpx.get(s.url + "/metrics").status_code == 200
    assert engine.shutdown_calls == [7.0]


def test_dead_engine_fails_fast():
    engine = FakeEngine()
    with serve_fake(engine) as s:
        engine.ready = False  # the real client's `ready`: its engine is alive and admitting
        assert_openai_error(httpx.get(s.url + "/health"), 503)
        assert_openai_error(httpx.post(s.url + CHAT, json={"messages": HI}, timeout=5), 503)


def test_drain_timeout_aborts_running_requests_cleanly():
    engine = FakeEngine(token_delay=0.02, max_model_len=4096)
    app = build_app(engine, ServerSettings(["fake"], drain_timeout=0.3))
    with ThreadServer(app) as s:
        body = {"messages": HI, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + CHAT, json=body, timeout=20) as r:
            lines = r.iter_lines()
            first = next(lines)
            app.state.gemma4serve.begin_drain()
            payloads = sse_data([first, *lines])
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort"
        wait_until(lambda: _pools_back(engine), what="KV pages to return")


# --------------------------------------------------------------------------------------------------
# Metrics


def test_continuous_usage_needs_include_usage(server):
    """vLLM's continuous_usage_stats: usage in every chunk, only beside include_usage."""
    for options, every, last in (
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
        ({"include_usage": True}, False, True),
        ({"continuous_usage_stats": True}, False, False),
    ):
        body = {"messages": HI, "max_tokens": 3, "stream": True, "stream_options": options}
        events = streamed_events(server.url + CHAT, body)
        assert all(e.get("usage") is not None for e in events[:-1]) == every, options
        assert (events[-1].get("usage") is not None) == last, options


def test_force_include_usage_and_no_docs():
    """vLLM's --enable-force-include-usage (usage in every chunk and a last one, whatever the
    request asks) and --disable-fastapi-docs."""
    with serve_fake(FakeEngine(), force_include_usage=True, openapi_docs=False) as s:
        body = {"messages": HI, "max_tokens": 3, "stream": True}
        events = streamed_events(s.url + CHAT, body)
        assert all(event["usage"] is not None for event in events)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(s.url + path).status_code == 404
    with serve_fake(FakeEngine()) as s:
        assert httpx.get(s.url + "/openapi.json").status_code == 200


def test_metrics_prefix_gives_vllms_names():
    """--metrics-prefix vllm: the same series under vLLM's own names."""
    with serve_fake(FakeEngine(), metrics_prefix="vllm") as s:
        assert httpx.post(s.url + CHAT, json={"messages": HI, "max_tokens": 2}).is_success
        text = httpx.get(s.url + "/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if ":" in line}
    names = {name for name in names if not name.startswith("#")}
    assert {"vllm:num_requests_running", "vllm:spec_decode_num_drafts_total"} <= names
    assert "vllm:time_to_first_token_seconds_count" in names
    assert not any(name.startswith("gemma4serve:") for name in names)


def test_metrics_parse_and_move(server, client):
    before = httpx.get(server.url + "/metrics").text
    client.chat.completions.create(model="fake", messages=HI, max_tokens=5)
    after = httpx.get(server.url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    after = after.text

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("gemma4serve:request_success_total", finished_reason="length") == 1
    assert delta("gemma4serve:generation_tokens_total") == 5
    assert delta("gemma4serve:prompt_tokens_total") > 0
    assert delta("gemma4serve:e2e_request_latency_seconds_count") == 1
    assert delta("gemma4serve:time_to_first_token_seconds_count") == 1
    assert delta("gemma4serve:request_queue_time_seconds_count") == 1
    assert delta("gemma4serve:time_per_output_token_seconds_count") == 1
    assert delta("gemma4serve:spec_decode_num_drafts_total") > 0
    assert metric(after, "gemma4serve:kv_cache_free_pages") > 0
    assert 0.0 <= metric(after, "gemma4serve:kv_cache_usage_perc") <= 1.0
    assert metric(after, "gemma4serve:prefix_cache_queries_total") >= 0
    assert metric(after, "gemma4serve:prefix_cache_hits_total") >= 0
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_mean_accepted_length",
    ):
        metric(after, "gemma4serve:" + name)
    assert (
        metric(after, "gemma4serve:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    )


# --------------------------------------------------------------------------------------------------
# Disconnects and load


@pytest.fixture
def slow():
    engine = FakeEngine(token_delay=0.02, max_model_len=4096)
    with serve_fake(engine) as s:
        yield engine, s


def _pools_back(engine: FakeEngine) -> bool:
    return not engine.active and engine.kv_pool_free() == {
        "full": engine.full_pages,
        "sliding": engine.sliding_pages,
    }


def test_disconnect_mid_stream_aborts(slow):
    engine, s = slow
    body = {"messages": HI, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + CHAT, json=body) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert request_id in engine.active
    # leaving the block closed the connection mid-stream
    wait_until(lambda: request_id in engine.aborted, what="the engine's generator to be cancelled")
    wait_until(lambda: _pools_back(engine), what="KV pages to return")
    assert request_id in engine.abort_calls


def test_disconnect_non_streaming_aborts(slow):
    engine, s = slow
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            s.url + COMPLETIONS,
            json={"prompt": "a", "max_tokens": 2000, "ignore_eos": True},
            timeout=0.5,
        )
    (request_id,) = engine.requests
    wait_until(lambda: request_id in engine.aborted, what="abort after a non-streaming client left")
    wait_until(lambda: _pools_back(engine), what="KV pages to return")


def test_a_repeated_request_id_runs_every_request(slow):
    """Two batched completions under one X-Request-Id, and one prompt whose id is a batch's first
    prompt's: the engine refuses an id in flight, so the server's engine ids must stay apart."""
    engine, s = slow

    def post(request_id: str, prompt) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True}
        return httpx.post(
            s.url + COMPLETIONS, json=body, headers={"X-Request-Id": request_id}, timeout=30
        )

    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(post, ["dup", "dup", "dup-0"], [["a", "b"], ["a", "b"], "a"]))
    for response, num_prompts in zip(responses, [2, 2, 1]):
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == num_prompts
        assert all(choice["finish_reason"] == "length" for choice in choices)
    assert len(engine.requests) == 5  # every prompt ran under an id of its own
    wait_until(lambda: _pools_back(engine), what="KV pages to return")


def test_disconnect_while_queued_aborts():
    # One request holds every page; a second waits for pages and leaves before its first token.
    engine = FakeEngine(
        token_delay=0.02, max_model_len=4096, full_pages=255, page_size=16
    )  # the hog takes 251
    with serve_fake(engine) as s:
        hog = {"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + COMPLETIONS, json=hog) as r:
            hog_lines = r.iter_lines()  # keep it: a dropped httpx line iterator closes the response
            next(hog_lines)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    s.url + COMPLETIONS, json={"prompt": "b", "max_tokens": 100}, timeout=0.5
                )
            waiting = [rid for rid in engine.requests if rid not in engine.active]
            assert len(waiting) == 1
            wait_until(
                lambda: waiting[0] in engine.aborted, what="the queued request to be aborted"
            )
        wait_until(lambda: _pools_back(engine), what="KV pages to return")


def test_100_concurrent_streams(server, engine):
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": f"client {i}"}],
            max_tokens=30,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run() -> list[str]:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=128), timeout=30)
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", http_client=http, max_retries=0
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(100))), 45)

    texts = asyncio.run(run())
    assert texts == [REPLY[:30]] * 100
    wait_until(lambda: _pools_back(engine), what="KV pages to return")


# --------------------------------------------------------------------------------------------------
# The real process: ready line, SIGTERM drain, exit code


def _fake_server(*extra: str) -> ServerProcess:
    return ServerProcess(["tests/fake_engine.py", "--port", "0", *extra], ready_timeout=30)


def test_sigterm_lets_running_stream_finish_and_exits_0():
    with _fake_server("--token-delay", "0.02", "--drain-timeout", "10") as proc:
        assert len(proc.ready_lines()) == 1 and proc.url.startswith("http://127.0.0.1:")
        assert not any("Uvicorn running on" in line for line in proc.lines)
        body = {"messages": HI, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + CHAT, json=body, timeout=20) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.signal(signal.SIGTERM)
            payloads = sse_data([first, *lines])
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.HTTPError):  # listener closed (or 503) once draining
            r = httpx.get(proc.url + "/health", timeout=2)
            if r.status_code == 503:
                raise httpx.HTTPError("503 while draining")
        assert proc.wait(15) == 0


def test_sigterm_keeps_the_listener_open_with_503_until_the_drain_ends():
    """While a stream drains after a real SIGTERM, new connections are answered (503 in OpenAI's
    format on /health and /v1), not refused; the stream finishes and the process exits 0."""
    with _fake_server("--token-delay", "0.05", "--drain-timeout", "30") as proc:
        body = {"messages": HI, "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + CHAT, json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.signal(signal.SIGTERM)
            wait_until(lambda: any("SIGTERM: draining" in line for line in proc.lines))
            assert_openai_error(httpx.get(proc.url + "/health", timeout=5), 503)
            assert_openai_error(httpx.post(proc.url + CHAT, json={"messages": HI}, timeout=5), 503)
            assert_openai_error(httpx.get(proc.url + "/v1/models", timeout=5), 503)
            payloads = sse_data([first, *lines])
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(15) == 0


def _stream_aborted_by(proc, stop) -> float:
    """Start a long stream, call `stop()` after its first event and check that the stream still
    ends well-formed (an "abort" chunk, then [DONE]); the seconds from `stop()` to that end."""
    body = {"messages": HI, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proc.url + CHAT, json=body, timeout=20) as r:
        lines = r.iter_lines()
        first = next(lines)
        started = time.monotonic()
        stop()
        payloads = sse_data([first, *lines])
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort"
    return time.monotonic() - started


def test_sigterm_aborts_what_outlives_the_drain_timeout():
    with _fake_server("--token-delay", "0.05", "--drain-timeout", "1") as proc:
        assert 0.8 < _stream_aborted_by(proc, lambda: proc.signal(signal.SIGTERM)) < 5
        assert proc.wait(15) == 0
        assert any("aborting 1 running request" in line for line in proc.lines)


def test_sigint_drains_too():
    with _fake_server() as proc:
        proc.signal(signal.SIGINT)
        assert proc.wait(15) == 0


def test_a_second_ctrl_c_aborts_the_running_streams_and_exits_cleanly():
    """Ctrl-C twice: the first drains, the second stops waiting for the running requests. Their
    streams still end well-formed ("abort", then [DONE]), the app's shutdown runs, no traceback
    is logged, and the process exits 0 long before the drain timeout."""
    with _fake_server("--token-delay", "0.05", "--drain-timeout", "30") as proc:

        def ctrl_c_twice():
            proc.signal(signal.SIGINT)
            wait_until(lambda: any("SIGINT: draining" in line for line in proc.lines))
            proc.signal(signal.SIGINT)

        started = time.monotonic()
        _stream_aborted_by(proc, ctrl_c_twice)
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 10
        assert any("Application shutdown complete" in line for line in proc.lines)
        assert not any("Traceback" in line for line in proc.lines), proc.lines


@pytest.mark.parametrize(
    "second_after", [0.0, 0.05, "Application shutdown complete", "Finished server process"]
)
def test_ctrl_c_twice_on_an_idle_server_exits_without_a_traceback(second_after):
    """A second Ctrl-C while an idle server is already stopping (a double tap, or a supervisor
    that forwards the terminal's signal) is no error: exit 0, the app's shutdown run, no
    traceback. Sent after seconds, or as a log line shows the shutdown's last steps (there
    Python's own handlers used to be back, and the process died by SIGINT)."""
    with _fake_server() as proc:
        proc.signal(signal.SIGINT)
        if isinstance(second_after, str):
            wait_until(lambda: any(second_after in line for line in proc.lines), what=second_after)
        else:
            time.sleep(second_after)
        proc.signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert any("Application shutdown complete" in line for line in proc.lines)
        assert not any("Traceback" in line for line in proc.lines), proc.lines


# --------------------------------------------------------------------------------------------------
# CLI


def test_cli_maps_vllm_flags_to_engine_args(monkeypatch):
    from gemma4serve.cli import engine_args, parse_args

    monkeypatch.delenv("GEMMA4SERVE_API_KEY", raising=False)
    ns = parse_args(
        [
            "--model",
            "google/gemma-4-31B-it",
            "--draft",
            "google/gemma-4-31B-it-assistant",
            "--max-model-len",
            "32K",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "4096",
            "--gpu-memory-utilization",
            "0.8",
            "--num-speculative-tokens",
            "3",
            "--kv-cache-memory",
            "2GiB",
            "--dtype",
            "half",
            "--device",
            "cpu",
            "--attention-backend",
            "torch",
            "--enforce-eager",
            "--seed",
            "5",
            "--forced-acceptance",
            "0.9,0.7",
            "--served-model-name",
            "gemma",
            "alias",
            "--load-format",
            "dummy",
            "--block-size",
            "32",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "gemma4",
            "--reasoning-parser",
            "gemma4",
            "--no-enable-prefix-caching",
        ]
    )
    a = engine_args(ns)
    assert not a.enable_prefix_caching
    assert (a.model, a.draft, a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens) == (
        "google/gemma-4-31B-it",
        "google/gemma-4-31B-it-assistant",
        32768,
        8,
        4096,
    )
    assert (a.gpu_memory_utilization, a.num_draft_tokens, a.kv_cache_memory, a.dtype, a.device) == (
        0.8,
        3,
        2 * 1024**3,
        "float16",
        "cpu",
    )
    assert (a.attention_backend, a.enforce_eager, a.seed, a.forced_acceptance) == (
        "torch",
        True,
        5,
        [0.9, 0.7],
    )
    assert (a.served_model_name, a.load_format, a.page_size) == ("gemma", "dummy", 32)
    assert ns.served_model_name == ["gemma", "alias"] and ns.host == "0.0.0.0" and ns.port == 8000
    assert (
        parse_args(
            ["--model", "m", "--forced-acceptance", "2.5", "--max-model-len", "8k"]
        ).forced_acceptance
        == 2.5
    )
    assert engine_args(parse_args(["--model", "m", "--max-model-len", "8k"])).max_model_len == 8000
    assert engine_args(parse_args(["--model", "m"])).num_draft_tokens == 4


def test_cli_api_key_from_env(monkeypatch, capsys):
    """--api-key first, then $GEMMA4SERVE_API_KEY, then vLLM's $VLLM_API_KEY."""
    from gemma4serve.cli import parse_args

    monkeypatch.delenv("GEMMA4SERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args(["--model", "m"]).api_keys == []
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert parse_args(["--model", "m"]).api_keys == ["from-vllm-env"]
    monkeypatch.setenv("GEMMA4SERVE_API_KEY", "from-env")
    assert parse_args(["--model", "m"]).api_keys == ["from-env"]
    assert parse_args(["--model", "m", "--api-key", "a", "b"]).api_keys == ["a", "b"]
    # an empty key (an unset variable in "$K1" "$K2") would let in a bearer token of nothing
    assert parse_args(["--model", "m", "--api-key", "a", ""]).api_keys == ["a"]
    assert parse_args(["--model", "m", "--api-key", ""]).api_keys == ["from-env"]
    with pytest.raises(ValueError, match="api_keys"):
        ServerSettings(["m"], api_keys=["a", ""])
    with pytest.raises(ValueError, match="api_keys"):
        ServerSettings(["m"], api_keys="sekret")
    with pytest.raises(SystemExit):  # --api-key takes several keys: MODEL after it is one
        parse_args(["--api-key", "k", "google/gemma-4-31B-it"])
    assert "put MODEL first" in capsys.readouterr().err


def test_cli_takes_vllms_spellings():
    """A `vllm serve` command line's spellings: underscores, --no- forms, human-readable counts,
    auto, capital log levels, vLLM's names of our flags; --quantization is refused clearly."""
    from gemma4serve.cli import engine_args, parse_args

    ns = parse_args(
        [
            "m",
            "--max_num_batched_tokens",
            "8k",
            "--max-model-len",
            "auto",
            "--gpu_memory_utilization=0.8",
            "--no-enforce-eager",
            "--no-enable-prefix-caching",
            "--log-level",
            "DEBUG",
            "--uvicorn-log-level",
            "WARNING",
            "--shutdown-timeout",
            "12",
            "--kv-cache-memory-bytes",
            "20g",
            "--speculative-config",
            '{"method": "gemma4_mtp", "model": "a", "num_speculative_tokens": 3}',
        ]
    )
    args = engine_args(ns)
    assert (args.max_num_batched_tokens, args.max_model_len) == (8000, None)
    assert (args.gpu_memory_utilization, args.enforce_eager) == (0.8, False)
    assert (ns.enable_prefix_caching, ns.log_level, ns.uvicorn_log_level) == (
        False,
        "debug",
        "warning",
    )
    assert (ns.drain_timeout, args.kv_cache_memory) == (12.0, 20 * 10**9)
    assert (ns.draft, ns.num_draft_tokens) == ("a", 3)
    assert parse_args(["m", "--max-model-len", "-1"]).max_model_len is None
    assert parse_args(["m", "--kv-cache-memory-bytes", "2G"]).kv_cache_memory == 2 * 1024**3
    with pytest.raises(SystemExit):
        parse_args(["m", "--quantization", "fp8"])
    ns = parse_args(["m", "--enable-prompt-tokens-details", "--enable-request-id-headers"])
    assert ns.enable_prompt_tokens_details and ns.enable_request_id_headers  # always on here
    with pytest.raises(SystemExit):  # off is not on offer
        parse_args(["m", "--no-enable-request-id-headers"])
    with pytest.raises(SystemExit, match="2"):  # vLLM's counts: a decimal needs a unit of 1000s
        parse_args(["m", "--max-num-batched-tokens", "1.5K"])
    assert parse_args(["m", "--max-num-batched-tokens", "2.5k"]).max_num_batched_tokens == 2500
    override = '{"temperature": 0.5, "presence_penalty": 0.1}'
    ns = parse_args(["m", "--override-generation-config", override])
    assert engine_args(ns).override_generation_config == {
        "temperature": 0.5,
        "presence_penalty": 0.1,
    }
    nulls = parse_args(["m", "--override-generation-config", '{"top_p": null}'])
    assert nulls.override_generation_config == {}  # vLLM skips a null
    for bad in (
        '{"max_new_tokens": 5}',
        '{"temperature": -1}',
        '{"top_k": "x"}',
        '{"top_k": true}',
    ):
        with pytest.raises(SystemExit):
            parse_args(["m", "--override-generation-config", bad])
    assert parse_args(["m", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    with pytest.raises(SystemExit):
        parse_args(["m", "--metrics-prefix", "vllm:"])


def test_cli_drain_timeout_from_env(monkeypatch):
    """The Docker image sets GEMMA4SERVE_DRAIN_TIMEOUT to fit `docker stop`'s grace; the flag
    still wins, and a value that is not a number is a usage error."""
    from gemma4serve.cli import parse_args

    monkeypatch.delenv("GEMMA4SERVE_DRAIN_TIMEOUT", raising=False)
    assert parse_args(["--model", "m"]).drain_timeout == 30.0
    monkeypatch.setenv("GEMMA4SERVE_DRAIN_TIMEOUT", "5")
    assert parse_args(["--model", "m"]).drain_timeout == 5.0
    assert parse_args(["--model", "m", "--drain-timeout", "12"]).drain_timeout == 12.0
    monkeypatch.setenv("GEMMA4SERVE_DRAIN_TIMEOUT", "five")
    with pytest.raises(SystemExit):
        parse_args(["--model", "m"])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--demo", "--model", "m"],
        ["--model", "m", "--port", "70000"],
        ["--model", "m", "--max-model-len", "lots"],
        ["--model", "m", "--dtype", "int3"],
        ["--model", "m", "--gpu-memory-utilization", "1.5"],
    ],
)
def test_cli_rejects_bad_arguments(argv, capsys):
    from gemma4serve.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["gemma4serve", "gemma4serve.cli"])
def test_cli_help_runs_without_an_engine(module):
    env = {"PYTHONPATH": str(REPO_ROOT), "GEMMA4SERVE_API_KEY": "do-not-print"}
    r = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 0 and "--draft" in r.stdout and "--demo" in r.stdout
    assert "do-not-print" not in r.stdout
