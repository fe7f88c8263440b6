"""tool_choice "required" and named functions, enforced by a grammar: every output of a random tiny
model, over seeds, is a well-formed Gemma call of an allowed tool whose arguments validate against
its schema; MTP changes no token; thinking comes before the grammar; bad tool_choice values get
a 400."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from fake_engine import free_pages, wait_for_free_pages
from test_server_real import MODEL, start_server

from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.spec import IN_THOUGHT, StructuredOutputsParams

pytestmark = [pytest.mark.timeout(300)]

# Strings have a maxLength so that a random model ends them; additionalProperties false checks that
# the grammar writes declared keys only.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 6},
        "Filters": {
            "type": "object",
            "properties": {
                "max_price": {"type": "number"},
                "in_stock": {"type": "boolean"},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 3},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["in_stock"],
            "additionalProperties": False,
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        "mode": {"const": "fast"},
    },
    "required": ["query", "mode"],
    "additionalProperties": False,
}
# Every bound the grammar enforces; the pattern is bounded so that a random model ends it.
BOOK = {
    "type": "object",
    "properties": {
        "guests": {"type": "integer", "minimum": 7, "maximum": 1234},
        "floor": {"type": "integer", "exclusiveMinimum": -15, "exclusiveMaximum": -3},
        "budget": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25},
        "share": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "code": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{1,3}$"},
        "name": {"type": "string", "minLength": 3, "maxLength": 5},
    },
    "required": ["guests", "floor", "budget", "share", "code", "name"],
    "additionalProperties": False,
}
SCHEMAS = {
    "book": BOOK,
    "get_weather": WEATHER,
    "search": SEARCH,
    "ping": {"type": "object", "maxProperties": 0},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: called with {}
]
HI = [{"role": "user", "content": "Use a tool."}]
N = 4  # choices per request: each a sample of its own seed (batched: cheaper than requests)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gemma4serve.demo.checkpoints import ensure_demo_model

    target, assistant = ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))
    proc = start_server(target, assistant)
    with proc:
        proc.free_pages_at_start = free_pages(proc)
        yield proc


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each of a declared tool with arguments its schema accepts."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def create(client, seed: int = 0, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=HI, tools=TOOLS, max_tokens=200, seed=seed, temperature=1.0, **fields
    )


def test_required_outputs_are_valid_calls(client):
    names = set()
    for choice in create(client, tool_choice="required", n=N).choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        calls = valid_calls(choice.message)
        assert calls
        names.update(name for name, _ in calls)
    assert len(names) >= 2  # the grammar lets the model pick among the tools


def test_bounded_arguments_over_seeds(client):
    """Integer and number bounds, string lengths and a pattern hold in every sample."""
    tools = [{"type": "function", "function": {"name": "book", "parameters": BOOK}}]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=tools,
            tool_choice="required",
            max_tokens=400,
            seed=seed,
            temperature=1.0,
            n=N,
        )
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            names = [name for name, _ in valid_calls(choice.message)]
            assert names and set(names) == {"book"}


def test_named_function_is_called_once(client):
    for name in ("search", "get_weather"):
        named = {"type": "function", "function": {"name": name}}
        for choice in create(client, tool_choice=named, n=N).choices:
            assert choice.finish_reason == "tool_calls"
            assert [n for n, _ in valid_calls(choice.message)] == [name]


def test_parallel_tool_calls_false_gives_one_call(client):
    r = create(client, seed=1, tool_choice="required", parallel_tool_calls=False, n=N)
    for choice in r.choices:
        assert len(valid_calls(choice.message)) == 1


def test_streaming_equals_non_streaming(client):
    fields = {"seed": 2, "tool_choice": "required", "n": 3}
    whole = create(client, **fields)
    streamed = {i: [] for i in range(3)}
    finish = {}
    for chunk in create(client, stream=True, **fields):
        for choice in chunk.choices:
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    streamed[choice.index].append([call.function.name, ""])
                streamed[choice.index][call.index][1] += call.function.arguments or ""
    for choice in whole.choices:
        joined = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [tuple(c) for c in streamed[choice.index]] == joined
        assert finish[choice.index] == choice.finish_reason == "tool_calls"


def test_thinking_comes_before_the_calls(client):
    """enable_thinking: the output may think first, then the grammar applies. The bias makes the
    random model open and close its channel."""
    choices = create(
        client,
        tool_choice="required",
        n=N,
        logit_bias={"100": 4.0, "101": 8.0},  # <|channel>, <channel|> of the demo tokenizer
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    ).choices
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and valid_calls(choice.message)
    assert sum(bool(choice.message.reasoning_content) for choice in choices) >= 2


def test_response_format_after_thinking(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    choices = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=200,
        n=N,
        seed=3,
        logit_bias={"100": 4.0, "101": 8.0},
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    ).choices
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert any(choice.message.reasoning_content for choice in choices)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "Invalid value for `tool_choice`"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "does not match any",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Correct usage"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}},
            "Correct usage",
        ),
    ],
)
def test_bad_tool_choice_is_a_400(server, body, words):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"], error


def test_unsatisfiable_tool_schema_is_a_400(server):
    empty = {"type": "integer", "minimum": 5, "maximum": 2}
    schema = {"type": "object", "properties": {"n": empty}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {"model": MODEL, "messages": HI, "tools": tools, "tool_choice": "required"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "minimum 5, maximum 2" in error["message"], error


def test_every_kv_page_comes_back(server):
    wait_for_free_pages(server, server.free_pages_at_start)


def test_mtp_gives_the_same_forced_calls(tiny_checkpoints):
    """The offline LLM.chat with and without the drafter: the same tokens, greedy and seeded,
    and every output parses into valid calls."""
    from gemma4serve.engine.llm import LLM

    target, assistant = tiny_checkpoints.get("dense"), tiny_checkpoints.get_assistant("dense")
    spec = LLM(str(target), draft=str(assistant), device="cpu", dtype="float32", num_draft_tokens=3)
    plain = LLM(str(target), device="cpu", dtype="float32")
    named = {"type": "function", "function": {"name": "search"}}
    for tool_choice in ("required", named):
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=200, temperature=temperature, seed=7, n=3)
            (with_drafts,) = spec.chat(HI, params, tools=TOOLS, tool_choice=tool_choice)
            (without,) = plain.chat(HI, params, tools=TOOLS, tool_choice=tool_choice)
            assert [c.token_ids for c in with_drafts.outputs] == [
                c.token_ids for c in without.outputs
            ]
            for choice in with_drafts.outputs:
                assert choice.finish_reason == "stop" and choice.tool_calls
                for call in choice.tool_calls:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert spec.engine.snapshot().spec_drafted_tokens > 0


def test_grammar_starts_inside_an_open_channel(tiny_checkpoints):
    """A prompt that leaves a thought channel open: the output starts in reasoning, and the call
    may start only after `<channel|>`."""
    from gemma4serve.structured.bitmask import new_bitmask
    from gemma4serve.structured.grammar import GrammarCompiler
    from gemma4serve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_checkpoints.get("dense"))
    ids = {text: tokenizer.token_to_id(text) for text in ("<|tool_call>", "<channel|>")}
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids))
    tools = json.dumps([{"name": "ping", "parameters": None}])
    state = compiler.matcher(StructuredOutputsParams(tool_calls=tools, thinking=IN_THOUGHT))
    mask = new_bitmask(1, tokenizer.vocab_size)

    def allowed(token: int) -> bool:
        state.fill_rows(mask, 0, [])
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)

    assert allowed(ids["<channel|>"]) and not allowed(ids["<|tool_call>"])
    for token in tokenizer.encode("Hm, a ping."):
        assert allowed(token)
        state.commit(token)
    state.commit(ids["<channel|>"])
    assert allowed(ids["<|tool_call>"]) and not allowed(ids["<channel|>"])
    for token in [ids["<|tool_call>"], *tokenizer.encode("call:ping{}")]:
        assert allowed(token)
        state.commit(token)


NOTATION_TOOL = {
    "type": "object",
    "properties": {
        "b": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        "A": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "c": {"enum": ["x", 2, True]},
        "odd:key": {"type": "boolean"},
    },
    "required": ["b", "extra"],
}
# The arguments text after `call:f` (keys in the template's order: case-insensitively sorted);
# `"` stands for the `<|"|>` token.
ACCEPTED = [
    '{b:[1],extra:"free text, {}: kept"}',
    '{A:-2.5e3,b:[0,-7],c:"x",extra:null}',
    '{A:null,b:[3],c:2,extra:{any_key:[true]},"odd:key":false}',
    "{b:[1],c:true,extra:12}",
]
REJECTED = [
    "{extra:1,b:[1]}",  # out of order
    "{b:[1]}",  # a required key missing
    "{b:[],extra:1}",  # minItems
    "{b:[1,2,3],extra:1}",  # maxItems
    "{b:[1.5],extra:1}",  # an integer item
    '{b:[1],c:"y",extra:1}',  # not in the enum
    "{b:[1],extra:1,z:1}",  # an undeclared key
    "{b:[01],extra:1}",  # not a number
    '{b:[1],extra:"a<eos>b"}',  # a special token's text inside a string
    "{ b:[1],extra:1}",  # whitespace
]


BOUNDS_TOOL = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 7, "maximum": 1234},
        "b": {"type": "integer", "exclusiveMinimum": -15, "exclusiveMaximum": -3},
        "c": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25},
        "d": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "e": {"type": "string", "minLength": 0},
        "f": {"type": "string", "minLength": 1, "maxLength": 2},
        "g": {"type": "string", "minLength": 3},
        "h": {"type": "string", "pattern": "^[a-z]{2}-[0-9]+$"},
        "i": {"type": "integer", "minimum": -2.5},
        "j": {"type": ["integer", "null"], "maximum": -100.5},
    },
}


def members(key: str, *values) -> list[str]:
    """`{key:value}` arguments, one per value."""
    return [f"{{{key}:{value}}}" for value in values]


BOUNDS_ACCEPTED = [
    *members("a", 7, 8, 99, 100, 999, 1000, 1199, 1229, 1234),
    "{b:-14}",
    "{b:-4}",
    *members("c", "-1.5", "-1.50", "-1.4999", "-1", "-0.75", "0", "2", "2.2499999999"),
    *members("d", "0.5", "1", "1.0", "0.000000000001", "0.999"),
    '{e:""}',
    '{e:"x"}',
    '{f:"a"}',
    '{f:"ab"}',
    '{g:"abc"}',
    '{g:"a b c d"}',
    '{h:"ab-1"}',
    '{h:"zz-1234"}',
    "{i:-2}",
    "{i:12345}",
    "{j:-101}",
    "{j:-5000}",
    "{j:null}",
]
BOUNDS_REJECTED = [
    *members("a", 6, 0, -7, 1235, 1240, 2000, 9999, 12340, "07", "7.0"),
    *members("b", -15, -3, -16, -2, 0, 3, 14),
    *members("c", "-1.51", "-1.5000001", "-2", "2.25", "2.250", "2.3", "3", "1e0"),
    *members("d", "0", "0.0", "-0", "-0.5", "1.0000001", "2", "0.0000000000001"),
    '{f:""}',
    '{f:"abc"}',
    '{g:""}',
    '{g:"ab"}',
    '{g:"ab<eos>"}',
    '{h:"a-1"}',
    '{h:"ab-"}',
    '{h:"AB-1"}',
    '{h:"ab-1x"}',
    '{h:"ab-1 "}',
    "{i:-3}",
    "{j:-100}",
    "{j:0}",
]


def notation_matcher(tiny_checkpoints):
    """accepts(schema, arguments): whether a call of a tool `f` of that schema may be written
    with those arguments (`"` stands for the `<|"|>` token)."""
    from gemma4serve.structured.grammar import GrammarCompiler
    from gemma4serve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_checkpoints.get("dense"))
    quote, call_open, call_close = (
        tokenizer.token_to_id(text) for text in ('<|"|>', "<|tool_call>", "<tool_call|>")
    )
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids))

    def accepts(schema: dict, arguments: str) -> bool:
        tools = json.dumps([{"name": "f", "parameters": schema}])
        matcher = compiler.matcher(StructuredOutputsParams(tool_calls=tools)).matcher
        assert matcher.accept_token(call_open) and matcher.accept_string("call:f")
        for i, text in enumerate(arguments.split('"')):
            if i and not matcher.accept_token(quote):
                return False
            if text and not matcher.accept_string(text):
                return False
        return matcher.accept_token(call_close) and matcher.accept_token(1)  # then <eos>

    return accepts, compiler


def test_notation_grammar_follows_the_schema(tiny_checkpoints):
    accepts, _ = notation_matcher(tiny_checkpoints)
    assert [arguments for arguments in ACCEPTED if not accepts(NOTATION_TOOL, arguments)] == []
    assert [arguments for arguments in REJECTED if accepts(NOTATION_TOOL, arguments)] == []


def test_notation_grammar_enforces_bounds(tiny_checkpoints):
    """minimum/maximum (inclusive and exclusive), minLength/maxLength and pattern; every
    accepted case also validates against the schema."""
    accepts, _ = notation_matcher(tiny_checkpoints)
    for arguments in BOUNDS_ACCEPTED:
        value = json.loads(re.sub(r"([a-z]):", r'"\1":', arguments))
        jsonschema.validate(value, BOUNDS_TOOL)  # the case itself is right
    assert [a for a in BOUNDS_ACCEPTED if not accepts(BOUNDS_TOOL, a)] == []
    assert [a for a in BOUNDS_REJECTED if accepts(BOUNDS_TOOL, a)] == []


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "integer", "minimum": 5, "maximum": 2}, "no integer"),
        ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer"),
        ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number"),
        ({"type": "number", "minimum": 1e300}, "no number"),
        ({"type": "number", "minimum": "3"}, "not a number"),
        ({"type": "string", "minLength": 4, "maxLength": 3}, "minLength 4 > maxLength 3"),
        ({"type": "string", "minLength": -1}, "not a non-negative integer"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "cannot be enforced"),
        ({"type": "string", "pattern": "a(?=b)"}, "Lookahead"),
        ({"type": "string", "pattern": "<[a-z]+>"}, "writes `<`"),
    ],
)
def test_unsatisfiable_tool_schema_is_a_request_error(tiny_checkpoints, schema, words):
    from gemma4serve.validation import RequestError

    accepts, _ = notation_matcher(tiny_checkpoints)
    with pytest.raises(RequestError) as error:
        accepts({"type": "object", "properties": {"x": schema}}, "{}")
    assert error.value.param == "tools" and words in str(error.value), error.value


def test_number_ranges_are_exact():
    """Every integer near the bounds, and random decimals, are accepted exactly when inside; a
    float bound's decimal reads as a float inside it."""
    import random
    from decimal import Decimal

    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from gemma4serve.structured import ranges

    for least, most in [(7, 1234), (-15, -3), (-5, 12), (0, 0), (-1, -1), (123, 129), (-1000, 99)]:
        grammar = xgrammar.Grammar.from_ebnf("root ::= " + ranges.integers(least, most))
        wrong = [
            v
            for v in range(least - 30, most + 30)
            if accepts(grammar, str(v)) != (least <= v <= most)
        ]
        assert wrong == [] and not any(accepts(grammar, s) for s in ("-0", "07", "+7", "7.0"))
    rng = random.Random(0)
    for low, high in [("-1.5", "2.25"), ("0.1", "0.3"), ("-0.05", "-0.01"), ("99.9", "100.01")]:
        least, most = Decimal(low), Decimal(high)
        grammar = xgrammar.Grammar.from_ebnf("root ::= " + ranges.decimals(least, most))
        texts = {
            f"{rng.uniform(float(least) - 1, float(most) + 1):.{rng.randint(0, 6)}f}"
            for _ in range(300)
        }
        texts |= {
            str(b + d) for b in (least, most) for d in (Decimal("-0.001"), 0, Decimal("0.001"))
        }
        wrong = [t for t in texts if accepts(grammar, t) != (least <= Decimal(t) <= most)]
        assert wrong == [] and not any(accepts(grammar, s) for s in ("1.", ".5", "1e0", "01"))
    for _ in range(2000):
        bound, exclusive = rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-9, 9), rng.random() < 0.5
        at_least = float(ranges.decimal_at_least(bound, exclusive))
        at_most = float(ranges.decimal_at_most(bound, exclusive))
        assert (
            (at_least > bound and at_most < bound) if exclusive else (at_least >= bound >= at_most)
        )


def test_async_scheduling_with_accepted_drafts_changes_no_forced_call(trained_chat_checkpoint):
    """A model taught its calls, and a drafter whose drafts it accepts: forced calls (a grammar
    mask along every verified draft) are the same tokens with steps continued on the device as
    without."""
    from trained_chat import EXAMPLES, WEATHER_TOOLS

    from gemma4serve.engine.llm import LLM

    target, assistant = trained_chat_checkpoint
    kw = dict(draft=str(assistant), device="cpu", num_draft_tokens=3, max_model_len=1024)
    on, off = LLM(str(target), **kw), LLM(str(target), async_scheduling=False, **kw)
    conversations = [EXAMPLES[name].messages for name in ("single call", "parallel calls")]
    greedy = SamplingParams(max_tokens=80, temperature=0)
    got, want = (
        llm.chat(conversations, greedy, tools=WEATHER_TOOLS, tool_choice="required")
        for llm in (on, off)
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    calls = [[(c.name, json.loads(c.arguments)) for c in o.outputs[0].tool_calls] for o in got]
    assert calls == [
        [("get_weather", {"city": "Rome", "days": 3})],
        [
            ("get_weather", {"city": "Oslo", "days": 2}),
            ("get_weather", {"city": "Lima", "days": 10}),
        ],
    ]
    stats = on.engine.snapshot()
    assert stats.spec_accepted_tokens > stats.spec_num_steps  # most drafts are accepted
    assert on.engine.num_continued_steps > 0 and off.engine.num_continued_steps == 0
