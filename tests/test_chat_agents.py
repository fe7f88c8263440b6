"""Tool calls and thinking end to end, with a tiny model trained in the test to write them.

The trained checkpoint (tests/trained_chat.py) writes known completions greedily: the offline
`LLM.chat` and the real server (with and without its MTP assistant, streamed and not, through the
official `openai` client) must split each into the same content, reasoning and tool calls, and an
agent loop written with the SDK runs against the server unchanged. The MTP assistant is trained too:
its drafts are accepted, so the server commits several tokens per step, markers and all."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ServerProcess, free_pages, metric, wait_for_free_pages
from trained_chat import (
    EXAMPLES,
    NUM_DRAFT_TOKENS,
    PARIS_ARGUMENTS,
    PARIS_REASONING,
    THINK,
    WEATHER_TOOLS,
)

from gemma4serve.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(600)]

MODEL = "tiny-agent"
WEATHER_ROME = ("get_weather", {"city": "Rome", "days": 3})
# Per example: content, reasoning, calls (name, arguments).
EXPECTED = {
    "single call": (None, None, [WEATHER_ROME]),
    "parallel calls": (
        None,
        None,
        [
            ("get_weather", {"city": "Oslo", "days": 2}),
            ("get_weather", {"city": "Lima", "days": 10}),
        ],
    ),
    "nested arguments": (
        None,
        None,
        [
            (
                "search",
                {
                    "code": "007",  # a string field keeps its digits
                    "filters": {"in_stock": True, "max_price": 19.5, "tags": ["desk", "led"]},
                    "note": None,
                    "query": 'lamp {big}: "red", a,b',
                },
            )
        ],
    ),
    "thinking then answer": ("The answer is 4.", "Add two and two.", []),
    "thinking then call": (None, PARIS_REASONING, [("get_weather", PARIS_ARGUMENTS)]),
    "agent answer": ("It is sunny in Paris, 21 C.", "The tool says sunny.", []),
    "open channel": ("Yes, very wide.", "The sea is wide.", []),
    "answer without tools": ("Once upon a time.", None, []),
    "colon opener": (None, None, [("get_weather", {"city": "Kyiv"})]),
    "paren opener": (None, None, [("get_weather", {"city": "Baku", "days": 2})]),
    "bare opener": ("Let me check.", None, [("get_weather", {"city": "Cairo"})]),
}


def test_llm_chat_splits_what_the_model_wrote(trained_chat_checkpoint):
    from gemma4serve.engine.llm import LLM

    target, _ = trained_chat_checkpoint
    llm = LLM(str(target), device="cpu", max_model_len=1024)
    greedy = SamplingParams(max_tokens=200, temperature=0)
    for name, example in EXAMPLES.items():
        (output,) = llm.chat(
            example.messages, greedy, tools=example.tools, chat_template_kwargs=example.kwargs
        )
        (choice,) = output.outputs
        content, reasoning, calls = EXPECTED[name]
        assert (choice.text, choice.reasoning) == (content or "", reasoning or ""), name
        assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == calls, name
        assert len({c.id for c in choice.tool_calls}) == len(calls)
    # Raw text on request: the markers stay, nothing is split out.
    example = EXAMPLES["thinking then answer"]
    raw = SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False)
    (output,) = llm.chat(
        example.messages, raw, tools=example.tools, chat_template_kwargs=example.kwargs
    )
    assert output.outputs[0].text.startswith("<|channel>thought\n")
    assert output.outputs[0].tool_calls is None
    # A template of the caller's, as vLLM's LLM.chat takes one.
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (output,) = llm.chat(example.messages, greedy, chat_template=template)
    assert output.prompt_token_ids == llm.tokenizer.encode("<bos>What is two plus two?")


def start_server(target, assistant) -> ServerProcess:
    draft = (
        ["--draft", str(assistant), "--num-draft-tokens", str(NUM_DRAFT_TOKENS)]
        if assistant
        else []
    )
    return ServerProcess(
        [
            "-m",
            "gemma4serve.cli",
            "--model",
            str(target),
            *draft,
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
            "--disable-uvicorn-access-log",
        ],
        ready_timeout=240,
    )


@pytest.fixture(scope="module", params=["mtp", "no-draft"])
def server(request, trained_chat_checkpoint):
    target, assistant = trained_chat_checkpoint
    with start_server(target, assistant if request.param == "mtp" else None) as process:
        process.mtp = request.param == "mtp"
        process.free_pages_at_start = free_pages(process)
        yield process


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def message_of(choice) -> tuple:
    message = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    reasoning = getattr(message, "reasoning_content", None)
    assert getattr(message, "reasoning", None) == reasoning
    return message.content, reasoning, calls


@pytest.mark.parametrize("name", list(EXPECTED))
def test_server_splits_the_completion_streamed_or_not(server, client, name):
    """Non-streamed: the expected message. Streamed: deltas that follow the rules and join to the
    same message. The MTP and plain servers run the same test: their outputs agree."""
    body = EXAMPLES[name].create_kwargs(model=MODEL, max_tokens=200, temperature=0)
    response = client.chat.completions.create(**body)
    (choice,) = response.choices
    assert message_of(choice) == EXPECTED[name]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)

    content, reasoning, streamed_calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        (delta_choice,) = chunk.choices
        delta = delta_choice.delta
        finish = delta_choice.finish_reason or finish
        for text in delta.content or "", getattr(delta, "reasoning_content", None) or "":
            assert "<|" not in text and "|>" not in text and "thought\n" not in text, text
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: its index, id, type and name
                assert call.index == len(streamed_calls) and call.type == "function"
                streamed_calls.append([call.function.name, call.function.arguments or "", 1])
            else:  # later ones: the index and a piece of the arguments
                assert call.index == len(streamed_calls) - 1 and call.function.name is None
                streamed_calls[call.index][1] += call.function.arguments
                streamed_calls[call.index][2] += 1
    assert finish == choice.finish_reason
    assert (content or None, reasoning or None) == EXPECTED[name][:2]
    assert [(n, a) for n, a, _ in streamed_calls] == [
        (c.function.name, c.function.arguments) for c in calls
    ]  # the joined pieces are exactly the non-streamed JSON text
    assert all(pieces > 2 for _, _, pieces in streamed_calls)  # sent as written, not whole
    if server.mtp:  # the trained drafter's drafts are accepted: steps commit several tokens
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric(metrics, "gemma4serve:spec_decode_num_accepted_tokens_total") > 0


def test_choices_are_parsed_apart_and_reasoning_can_be_dropped(client):
    example = EXAMPLES["parallel calls"]
    body = example.create_kwargs(model=MODEL, max_tokens=200, temperature=0, n=2)
    response = client.chat.completions.create(**body)
    assert [message_of(c) for c in response.choices] == [EXPECTED["parallel calls"]] * 2
    calls = {0: [], 1: []}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls[choice.index].append(call.index)
    assert calls == {0: [0, 1], 1: [0, 1]}  # each choice numbers its own calls

    example = EXAMPLES["thinking then answer"]
    body = example.create_kwargs(model=MODEL, max_tokens=200, temperature=0)
    body["extra_body"]["include_reasoning"] = False
    response = client.chat.completions.create(**body)
    assert message_of(response.choices[0]) == ("The answer is 4.", None, [])


def streamed_message(client, body) -> tuple[str, list, str]:
    """A streamed response's content, calls (name, arguments text) and finish_reason."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        (choice,) = chunk.choices
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
    return content, [(name, json.loads(arguments)) for name, arguments in calls], finish


@pytest.mark.parametrize("name", ["single call", "thinking then call", "parallel calls"])
def test_forced_calls_let_the_model_write_its_call(client, name):
    """tool_choice "required" and a named function: the grammar allows exactly what the trained
    model writes (thinking first, when on); a named function is called once."""
    content, reasoning, calls = EXPECTED[name]
    named = {"type": "function", "function": {"name": calls[0][0]}}
    for tool_choice, wanted in (("required", calls), (named, calls[:1])):
        body = EXAMPLES[name].create_kwargs(
            model=MODEL, max_tokens=200, temperature=0, tool_choice=tool_choice
        )
        (choice,) = client.chat.completions.create(**body).choices
        assert message_of(choice) == (content, reasoning, wanted)
        assert choice.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """As vLLM: under "auto" the model's second call is dropped; under "required" the grammar
    ends the output after one call."""
    first = EXPECTED["parallel calls"][2][:1]
    for tool_choice in ("auto", "required"):
        body = EXAMPLES["parallel calls"].create_kwargs(
            model=MODEL,
            max_tokens=200,
            temperature=0,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
        )
        (choice,) = client.chat.completions.create(**body).choices
        assert message_of(choice) == (None, None, first)
        assert choice.finish_reason == "tool_calls"
        assert streamed_message(client, body) == ("", first, "tool_calls")


def test_tool_choice_none_parses_no_calls(client):
    """As vLLM: the tools stay in the prompt and what the model writes is content; the call
    markers, special tokens, are not."""
    body = EXAMPLES["single call"].create_kwargs(
        model=MODEL, max_tokens=200, temperature=0, tool_choice="none"
    )
    (choice,) = client.chat.completions.create(**body).choices
    text = "call:get_weather{city:Rome,days:3}"
    assert message_of(choice) == (text, None, [])
    assert choice.finish_reason == "stop"
    assert streamed_message(client, body) == (text, [], "stop")


def test_agent_loop_with_thinking(client):
    """An agent loop as written against any OpenAI server: the model calls the tool, the loop
    runs it and sends the result back, the model answers."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ran = []

    def get_weather(city: str, days: int) -> str:
        ran.append((city, days))
        return "sunny, 21 C"

    for _ in range(4):
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=WEATHER_TOOLS,
            temperature=0,
            max_tokens=200,
            extra_body={"chat_template_kwargs": THINK},
        )
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = get_weather(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    assert ran == [("Paris", 1)]
    assert message.content == "It is sunny in Paris, 21 C."
    assert response.choices[0].finish_reason == "stop"


def test_every_kv_page_comes_back(server):
    """Runs after the tests above on the same server: nothing they ran holds a page."""
    wait_for_free_pages(server, server.free_pages_at_start)
