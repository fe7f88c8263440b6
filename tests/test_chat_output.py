"""Reasoning and tool calls out of a Gemma 4 chat completion.

The argument notation, the parser's states, and the chat format's OpenAI fields, streamed and not,
with the tiny tokenizer's special tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from gemma4serve.demo.tokenizer import build_tiny_tokenizer
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput
from gemma4serve.server.chat_output import ChatDelta, ChatMarkers, ChatOutputParser
from gemma4serve.server.formats import ChatFormat
from gemma4serve.server.protocol import ChatCompletionRequest, ResponseHeader, TokenStrings
from gemma4serve.server.tool_arguments import NotationError, arguments_json
from gemma4serve.tokenizer import Tokenizer

Q = '<|"|>'
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "zip": {"type": "string"},
        "scale": {"type": "number"},
        "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def markers(tokenizer) -> ChatMarkers:
    found = ChatMarkers.from_tokenizer(tokenizer)
    assert found is not None
    return found


# ---- the argument notation ---------------------------------------------------------------------


def test_arguments_typed_by_the_schema():
    text = f'{{city:{Q}Paris, {{France}}: "x"{Q},days:3,zip:{Q}75001{Q},scale:2.5e1,'
    text += f"detail:{{hourly:true}},tags:[{Q}a,b{Q},{Q}c{Q}]}}"
    assert json.loads(arguments_json(text, WEATHER)) == {
        "city": 'Paris, {France}: "x"',
        "days": 3,
        "zip": "75001",
        "scale": 25.0,
        "detail": {"hourly": True},
        "tags": ["a,b", "c"],
    }


def test_arguments_without_a_schema_and_a_string_field_holding_digits():
    assert json.loads(arguments_json("{a:3,b:-1.5,c:null,d:false,e:word}", None)) == {
        "a": 3,
        "b": -1.5,
        "c": None,
        "d": False,
        "e": "word",
    }
    assert json.loads(arguments_json("{zip:3}", WEATHER)) == {"zip": "3"}  # a string field
    assert json.loads(arguments_json(f"{{{Q}city{Q}:{Q}Oslo{Q}}}", WEATHER)) == {"city": "Oslo"}


@pytest.mark.parametrize("bad", ["{city:", f"{{city:{Q}Paris}}", "{city:1}}", "[1]", "{a 1}"])
def test_malformed_arguments_are_refused(bad):
    with pytest.raises(NotationError):
        arguments_json(bad, None)


# ---- the parser ----------------------------------------------------------------------------------


def parse(markers, pieces: list[str], in_reasoning=False) -> ChatDelta:
    parser = ChatOutputParser(markers, {"get_weather": WEATHER}, in_reasoning)
    total = ChatDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    return total


CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
COMPLETIONS = {
    "thinking then answer": "<|channel>thought\nLet me add.<channel|>The answer is 4.<turn|>",
    "thinking then call": f"<|channel>thought\nNeed weather.<channel|>{CALL}<|tool_response>",
    "parallel calls": f"Checking.\n{CALL}{CALL.replace('Paris', 'Oslo')}<|tool_response>",
    "answer only": "Plain text, {braces} and: colons.<turn|>",
    "bare label": "thought\nThe answer.<turn|>",
    "malformed openers": f"<|tool_call>:get_weather{{days:1}}<tool_call|>"
    f"<|tool_call>call:get_weather(city:{Q}Rome{Q})<tool_call|>",
    "stray closers": "<channel|>Hi<tool_call|> there<turn|>",
    "unclosed call": f"<|tool_call>call:get_weather{{city:{Q}Par",
}
EXPECTED = {
    "thinking then answer": ("The answer is 4.", "Let me add.", []),
    "thinking then call": ("", "Need weather.", [("get_weather", {"city": "Paris", "days": 2})]),
    "parallel calls": (
        "Checking.",
        "",
        [
            ("get_weather", {"city": "Paris", "days": 2}),
            ("get_weather", {"city": "Oslo", "days": 2}),
        ],
    ),
    "answer only": ("Plain text, {braces} and: colons.", "", []),
    "bare label": ("The answer.", "", []),
    "malformed openers": (
        "",
        "",
        [("get_weather", {"days": 1}), ("get_weather", {"city": "Rome"})],
    ),
    "stray closers": ("Hi there", "", []),
    "unclosed call": ('call:get_weather{city:"Par', "", []),
}


def special_safe_splits(markers, text: str, rng: random.Random) -> list[str]:
    """`text` cut at random points that never fall inside a special token (they arrive whole)."""
    spans = []
    for special in markers.specials:
        start = text.find(special)
        while start >= 0:
            spans.append((start, start + len(special)))
            start = text.find(special, start + 1)
    cuts = sorted(
        cut
        for cut in rng.sample(range(1, len(text)), min(6, len(text) - 1))
        if not any(a < cut < b for a, b in spans)
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_parser_one_shot_and_streamed_agree(markers, name):
    content, reasoning, calls = EXPECTED[name]
    rng = random.Random(name)
    for pieces in [[COMPLETIONS[name]]] + [
        special_safe_splits(markers, COMPLETIONS[name], rng) for _ in range(20)
    ]:
        got = parse(markers, pieces)
        assert (got.content, got.reasoning) == (content, reasoning), pieces
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
        assert [c.index for c in got.tool_calls] == list(range(len(calls)))
        assert len({c.id for c in got.tool_calls}) == len(calls)


def test_label_split_over_deltas_and_a_prompt_ending_inside_the_channel(markers):
    got = parse(markers, ["<|channel>thou", "ght", "\nstep one", "<channel|>done"])
    assert (got.reasoning, got.content) == ("step one", "done")
    # The prompt left the channel open: the completion starts inside reasoning, without a label.
    got = parse(markers, ["still thinking<channel|>", CALL], in_reasoning=True)
    assert (got.reasoning, got.content, len(got.tool_calls)) == ("still thinking", "", 1)


def test_start_state_comes_from_the_prompt(markers, tokenizer):
    ids = tokenizer.encode
    assert markers.starts_in_reasoning(ids("<|turn>model\n<|channel>thought\n"))
    assert not markers.starts_in_reasoning(ids("<|turn>model\n<|channel>thought\n<channel|>"))
    assert not markers.starts_in_reasoning(ids("<|channel>x<|turn>model\n"))


# ---- the chat format --------------------------------------------------------------------------


def chat_format(tokenizer, markers, **fields) -> ChatFormat:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    request = ChatCompletionRequest.model_validate(body)
    header = ResponseHeader("chatcmpl-1", 0, "tiny")
    return ChatFormat(header, request, TokenStrings(tokenizer), 5, markers=markers)


def outputs(pieces: list[str]) -> list[RequestOutput]:
    """Engine outputs of one choice that writes `pieces`, one piece per step."""
    result, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        choice = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(range(i + 1)),
            new_text=piece,
            new_token_ids=[i],
            finish_reason="stop" if last else None,
        )
        result.append(RequestOutput("r", [2, 105], [choice], last))
    return result


def test_chat_format_streamed_and_whole_agree(tokenizer, markers):
    text = COMPLETIONS["thinking then call"] + CALL.replace("Paris", "Oslo")
    pieces = special_safe_splits(markers, text, random.Random(3))
    body = chat_format(tokenizer, markers).body(outputs(pieces)[-1], {})
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None
    assert message["reasoning_content"] == message["reasoning"] == "Need weather."
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Oslo", "days": 2}),
    ]

    stream = chat_format(tokenizer, markers)
    deltas, finish = [], None
    for output in outputs(pieces):
        for chunk in stream.step(output):
            for choice in chunk["choices"]:
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert not any(d.get("content") for d in deltas)
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == [0, 1]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed
    ] == calls


def test_include_reasoning_false_and_raw_special_tokens(tokenizer, markers):
    final = outputs([COMPLETIONS["thinking then answer"]])[-1]
    message = chat_format(tokenizer, markers, include_reasoning=False).body(final, {})
    assert message["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}
    raw = chat_format(tokenizer, markers, skip_special_tokens=False)
    assert not raw.parses_output
    assert raw.body(final, {})["choices"][0]["message"]["content"] == final.outputs[0].text
