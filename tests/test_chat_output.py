"""Reasoning and tool calls out of a Gemma 4 chat completion.

The argument notation, the parser's states, and the chat format's OpenAI fields, streamed and not,
with the tiny tokenizer's special tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from gemma4serve.chat.arguments import NotationError, arguments_json
from gemma4serve.chat.output import LABEL, ChatDelta, ChatMarkers, ChatOutputParser
from gemma4serve.demo.tokenizer import build_tiny_tokenizer
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gemma4serve.server.formats import ChatFormat, Prompt
from gemma4serve.server.protocol import ChatCompletionRequest, ResponseHeader, TokenStrings
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
    "bare opener": f"Checking.\ncall:get_weather{{days:108}} call:get_weather(city:{Q}Oslo{Q})",
    "text with call:": "Please call: 555. recall:get_weather{x} or call:unknown{a:1}<turn|>",
    "not a call head": "<|tool_call>hello, world<tool_call|>Bye",
    "nested and typed": f'<|tool_call>call:get_weather{{city:{Q}{{a:[1]}}, "q": x{Q},'
    f"detail:{{hourly:false}},scale:-2.5e3,tags:[{Q}x{Q},{Q}y{Q}],zip:00,other:null}}"
    "<tool_call|>",
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
    "unclosed call": ("", "", [("get_weather", {"city": "Par"})]),
    "bare opener": (
        "Checking.",
        "",
        [("get_weather", {"days": 108}), ("get_weather", {"city": "Oslo"})],
    ),
    "text with call:": ("Please call: 555. recall:get_weather{x} or call:unknown{a:1}", "", []),
    "not a call head": ("hello, worldBye", "", []),
    "nested and typed": (
        "",
        "",
        [
            (
                "get_weather",
                {
                    "city": '{a:[1]}, "q": x',
                    "detail": {"hourly": False},
                    "scale": -2500.0,
                    "tags": ["x", "y"],
                    "zip": "00",
                    "other": None,
                },
            )
        ],
    ),
}


def random_splits(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random points, also inside special tokens (a model may write one's text)."""
    cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(1, 12), len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed_deltas(markers, pieces: list[str], in_reasoning=False) -> list[ChatDelta]:
    parser = ChatOutputParser(markers, {"get_weather": WEATHER}, in_reasoning)
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_parser_one_shot_and_streamed_agree(markers, name):
    """Whole, character by character, and cut anywhere: the same reasoning, content and calls."""
    content, reasoning, calls = EXPECTED[name]
    text = COMPLETIONS[name]
    rng = random.Random(name)
    splits = [[text], list(text)] + [random_splits(text, rng) for _ in range(30)]
    for pieces in splits:
        got = parse(markers, pieces)
        assert (got.content, got.reasoning) == (content, reasoning), pieces
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, pieces
        assert [c.index for c in got.tool_calls] == list(range(len(calls)))
        assert len({c.id for c in got.tool_calls}) == len(calls)


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_streamed_deltas_follow_the_rules(markers, name):
    """A call's first delta has its id and name and the others only argument pieces, in order of
    index; no delta holds special-token text or the label."""
    text = COMPLETIONS[name]
    whole = parse(markers, [text])
    rng = random.Random(name)
    for pieces in [list(text)] + [random_splits(text, rng) for _ in range(30)]:
        deltas = streamed_deltas(markers, pieces)
        started: list[int] = []
        for delta in deltas:
            for piece in delta.content, delta.reasoning:
                assert not any(special in piece for special in markers.specials), piece
                assert "<|" not in piece and "|>" not in piece, piece
            assert LABEL not in delta.reasoning
            for call in delta.tool_calls:
                if call.id is not None:
                    assert call.index == len(started) and call.name
                    started.append(call.index)
                else:
                    assert started and call.index == started[-1] and call.arguments
        for field in "content", "reasoning":
            assert "".join(getattr(d, field) for d in deltas) == getattr(whole, field)
        arguments = [
            "".join(c.arguments for d in deltas for c in d.tool_calls if c.index == i)
            for i in started
        ]
        assert arguments == [c.arguments for c in whole.tool_calls]


def test_arguments_stream_holds_back_what_may_change(markers):
    parser = ChatOutputParser(markers, {"get_weather": WEATHER}, False)

    def arguments(piece: str) -> str:
        return "".join(c.arguments for c in parser.feed(piece).tool_calls)

    assert arguments("<|tool_call>call:get_weather{days:10") == '{"days": '  # 10 may go on
    assert arguments("8.") == ""
    assert arguments("5,detail:{hourly:tr") == '108.5, "detail": {"hourly": '
    assert arguments("ue") == ""
    assert arguments("},city:<") == 'true}, "city": '  # `<` may start `<|"|>`
    assert arguments('|"|>Par') == '"Par'
    assert arguments("is<|") == "is"
    assert arguments('"|>') == '"'
    assert arguments("}") == "}"
    assert parser.feed("<tool_call|>") == ChatDelta()


def test_calls_closing_and_opening_in_one_delta(markers):
    """MTP commits several tokens at once: a call closes, the next opens, text follows."""
    first, second = CALL, CALL.replace("Paris", "Oslo")
    deltas = streamed_deltas(markers, ["<|channel>thought\nHm", f".<channel|>{first}{second}ok"])
    assert [d.reasoning for d in deltas] == ["Hm", ".", ""]
    calls = deltas[1].tool_calls
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "get_weather")]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert deltas[1].content == "ok"


def test_bare_opener_needs_the_request_tools(markers):
    parser = ChatOutputParser(markers, {}, False)
    got = parser.feed("call:get_weather{days:1}")
    got += parser.finish()
    assert got == ChatDelta(content="call:get_weather{days:1}")
    # Held while it may be an opener, released when it is not one.
    parser = ChatOutputParser(markers, {"get_weather": WEATHER}, False)
    assert parser.feed("Now call:get_wea") == ChatDelta(content="Now")
    assert parser.feed("ther!") == ChatDelta(content=" call:get_weather!")


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
    return ChatFormat(header, request, TokenStrings(tokenizer), [Prompt([2] * 5)], markers=markers)


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


def stream_deltas(fmt: ChatFormat, steps: list[RequestOutput]) -> tuple[dict, dict]:
    """Each choice's deltas and finish reason, from the chunks `fmt` streams."""
    deltas, finish = {}, {}
    for output in steps:
        for chunk in fmt.step(output):
            for choice in chunk["choices"]:
                deltas.setdefault(choice["index"], []).append(choice["delta"])
                finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    return deltas, finish


def joined_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    """The calls of streamed deltas as OpenAI clients join them, checking each delta's shape."""
    calls: list[dict] = []
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


def test_chat_format_streamed_and_whole_agree(tokenizer, markers):
    text = COMPLETIONS["thinking then call"] + CALL.replace("Paris", "Oslo")
    pieces = random_splits(text, random.Random(3))
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
    deltas, finish = stream_deltas(chat_format(tokenizer, markers), outputs(pieces))
    assert finish == {0: "tool_calls"}
    assert "".join(d.get("reasoning_content", "") for d in deltas[0]) == "Need weather."
    assert not any(d.get("content") for d in deltas[0])
    assert joined_calls(deltas[0]) == calls


def test_choices_have_their_own_parsers(tokenizer, markers):
    """n=2: one choice stops inside a call's string while the other writes plain text; the
    parser state of one never reaches the other."""
    texts = [f"<|tool_call>call:get_weather{{city:{Q}a}}b", "plain}{ text<channel|> end"]
    steps, sofar = [], ["", ""]
    for i in range(max(map(len, texts))):
        choices = []
        for index, text in enumerate(texts):
            if i < len(text):
                sofar[index] += text[i]
                finish = "stop" if i == len(text) - 1 else None
                choices.append(
                    CompletionOutput(index, sofar[index], new_text=text[i], finish_reason=finish)
                )
        steps.append(RequestOutput("r", [2, 105], choices, i == max(map(len, texts)) - 1))
    deltas, finish = stream_deltas(chat_format(tokenizer, markers, n=2), steps)
    assert finish == {0: "tool_calls", 1: "stop"}
    assert joined_calls(deltas[0]) == [("get_weather", {"city": "a}b"})]
    assert "".join(d.get("content", "") for d in deltas[1]) == "plain}{ text end"


def test_include_reasoning_false_and_raw_special_tokens(tokenizer, markers):
    final = outputs([COMPLETIONS["thinking then answer"]])[-1]
    message = chat_format(tokenizer, markers, include_reasoning=False).body(final, {})
    assert message["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}
    # the reasoning's token ids and logprobs would show it: dropped with it, as vLLM drops them
    asks = dict(return_token_ids=True, logprobs=True)
    hidden = chat_format(tokenizer, markers, include_reasoning=False, **asks)
    choice = hidden.body(final, {0: [TokenLogprob(7, -0.5, [])]})["choices"][0]
    assert "token_ids" not in choice and choice["logprobs"] is None
    pieces = random_splits(COMPLETIONS["thinking then answer"], random.Random(5))
    chunks = [c for o in outputs(pieces) for c in hidden.step(o)]
    assert not any("token_ids" in c for chunk in chunks for c in chunk["choices"])
    shown = chat_format(tokenizer, markers, **asks).body(final, {0: [TokenLogprob(7, -0.5, [])]})
    assert shown["choices"][0]["token_ids"] == final.outputs[0].token_ids
    assert shown["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    raw = chat_format(tokenizer, markers, skip_special_tokens=False)
    assert not raw.parses_output
    assert raw.body(final, {})["choices"][0]["message"]["content"] == final.outputs[0].text


FRAGMENTS = [
    *("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", Q, "<turn|>", "<", "|", '"'),
    *("thought\n", "tho", "call:", "call:get_weather{", "get_weather", "city", "days", "x y"),
    *("{", "}", "(", ")", "[", "]", ":", ",", " ", "\n", "12", "1.5e", "true", "nul", "l"),
]


@pytest.mark.parametrize("seed", range(300))
def test_random_text_is_parsed_the_same_in_any_pieces(markers, seed):
    """Any text, even malformed: the same result whole and in pieces, calls with JSON-object
    arguments, no special-token text in content or reasoning."""
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
    in_reasoning = rng.random() < 0.3

    def result(pieces):
        got = parse(markers, pieces, in_reasoning)
        return got.content, got.reasoning, [(c.index, c.name, c.arguments) for c in got.tool_calls]

    whole = result([text])
    assert result(list(text)) == whole
    if len(text) > 1:
        assert result(random_splits(text, rng)) == whole
    content, reasoning, calls = whole
    assert not any(special in content + reasoning for special in markers.specials)
    assert all(isinstance(json.loads(arguments), dict) for _, _, arguments in calls)
