"""Structured output (response_format json_object / json_schema; vLLM's regex, choice and
grammar): every output of random tiny models parses and validates or matches, MTP changes no
constrained token, bad schemas, regexes and grammars get a 400."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from fake_engine import free_pages, wait_for_free_pages
from test_server_real import MODEL, start_server

from gemma4serve.engine.llm import LLM
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.spec import StructuredOutputsParams

pytestmark = [pytest.mark.timeout(300)]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 3, "maximum": 40},
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# The bounds xgrammar's converter enforces; the pattern is bounded so that a random model ends it.
BOUNDED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{1,3}$"},
        "nick": {"type": "string", "minLength": 2, "maxLength": 4},
        "level": {"type": "integer", "exclusiveMinimum": -15, "exclusiveMaximum": -3},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5},
        "count": {"type": "integer", "minimum": 7, "maximum": 1234},
    },
    "required": ["code", "nick", "level", "ratio", "count"],
    "additionalProperties": False,
}
HI = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gemma4serve.demo.checkpoints import ensure_demo_model

    target, assistant = ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))
    with start_server(target, assistant) as proc:
        yield proc


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_strict_json(text: str) -> object:
    """Parses as JSON with no raw control character inside a string (json.loads(strict=True))."""
    text.encode("utf-8")  # no lone surrogate: a valid code point sequence
    return json.loads(text, strict=True)


def schema_outputs(client, response_format: dict, seeds: range, **extra) -> list[str]:
    """One sampled chat answer per seed under `response_format`, each ended by the grammar and
    valid against SCHEMA."""
    texts = []
    for seed in seeds:
        r = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=MAX_TOKENS,
            seed=seed,
            temperature=1.5,
            response_format=response_format,
            **extra,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # ended by the grammar
        jsonschema.validate(check_strict_json(choice.message.content), SCHEMA)
        texts.append(choice.message.content)
    return texts


def test_json_schema_outputs_validate_over_seeds(server, client):
    free0 = free_pages(server)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    schema_outputs(client, response_format, range(8))
    wait_for_free_pages(server, free0)


def test_bounds_hold_over_seeds(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED}}
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=MAX_TOKENS,
            seed=seed,
            temperature=1.5,
            n=4,
            response_format=response_format,
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(check_strict_json(choice.message.content), BOUNDED)


def test_json_object_on_completions_and_chat(client):
    # Strings are unbounded in json_object, so a random model may run one to max_tokens.
    finished = 0
    for seed in range(5):
        choice = client.completions.create(
            model=MODEL,
            prompt="JSON:",
            max_tokens=100,
            seed=seed,
            temperature=1.0,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(check_strict_json(choice.text), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and choice.text.startswith("{")
    assert finished >= 1
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=100, seed=1, response_format={"type": "json_object"}
    )
    assert r.choices[0].message.content.startswith("{")


def test_vllm_spellings(server):
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        body = {"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS, "seed": 3, **extra}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        jsonschema.validate(check_strict_json(r.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize(
    "extra, holds",
    [
        (
            {"guided_choice": ["red", "green", 'bl"ue\n']},
            lambda t: t in ("red", "green", 'bl"ue\n'),
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "[a-c]{2,5}-[0-9]{1,2}"}, re.compile("[a-c]{2,5}-[0-9]{1,2}").fullmatch),
        ({"structured_outputs": {"regex": "(ab|cd){1,3}!"}}, re.compile("(ab|cd){1,3}!").fullmatch),
        (
            {"guided_grammar": 'root ::= "(" digit digit? ")"\ndigit ::= [0-9]'},
            re.compile(r"\([0-9]{1,2}\)").fullmatch,
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= ("x" | "y") "=" [0-9]'}},
            re.compile("[xy]=[0-9]").fullmatch,
        ),
    ],
)
def test_regex_choice_and_grammar_hold_over_seeds(server, extra, holds):
    """vLLM's regex, choice and grammar constraints (structured_outputs and the older guided_*
    fields), on completions and on chat: every output of the random model matches (each is
    bounded, so that the random model ends it)."""
    free0 = free_pages(server)
    for seed in range(4):
        for path, prompt in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": HI}),
        ):
            body = {"model": MODEL, "max_tokens": 60, "seed": seed, "temperature": 1.0, **prompt}
            r = httpx.post(server.url + path, json=body | extra, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and holds(text), (extra, text)
    wait_for_free_pages(server, free0)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"guided_regex": "(ab"}, "the regex cannot be used"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "the grammar cannot be used"),
    ],
)
def test_a_bad_regex_or_grammar_is_a_400(server, extra, words):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and words in error["message"], error


def whitespace_outside_strings(text: str) -> str:
    """The whitespace characters of a JSON text that are not inside a string."""
    found, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            found.append(ch)
    return "".join(found)


def test_disable_any_whitespace_gives_compact_json(server, client):
    """vLLM's structured_outputs.disable_any_whitespace: the JSON kinds without whitespace
    between tokens (beside response_format too, as vLLM merges them); alone, or not a boolean,
    a 400."""
    assert whitespace_outside_strings('{"a b": [1, 2],\n "c\\"": 3}') == "  \n  "
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    for text in schema_outputs(client, response_format, range(4), extra_body=compact):
        assert whitespace_outside_strings(text) == "", text
    for extra in (compact, {"structured_outputs": {"disable_any_whitespace": "yes", "json": {}}}):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, **extra}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


@pytest.mark.parametrize("pattern", [".*", "\\S+", "[^x]*"])
def test_no_marker_token_enters_a_regex_answer_after_thinking(tiny_checkpoints, pattern):
    """With thinking on, the answer's regex is compiled beside the marker tokens (the thought
    channel needs them): no character class of the user's regex may take one, so the output
    parser reads the answer back whole."""
    from gemma4serve.structured.bitmask import new_bitmask
    from gemma4serve.structured.grammar import MARKER_TEXTS, GrammarCompiler
    from gemma4serve.structured.spec import MAY_THINK
    from gemma4serve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_checkpoints.get("dense"))
    markers = {text: tokenizer.token_to_id(text) for text in MARKER_TEXTS}
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids))
    state = compiler.matcher(StructuredOutputsParams(regex=pattern, thinking=MAY_THINK))
    mask = new_bitmask(1, tokenizer.vocab_size)

    def allowed() -> set[str]:
        state.fill_rows(mask, 0, [])
        return {t for t, i in markers.items() if (int(mask[0, i // 32]) >> (i % 32)) & 1}

    assert allowed() == {"<|channel>"}  # the optional thought, and no marker as answer text
    for token in [markers["<|channel>"], *tokenizer.encode("hm"), markers["<channel|>"]]:
        state.commit(token)
    assert allowed() == set()
    for token in tokenizer.encode("ok"):
        state.commit(token)
        assert allowed() == set()


def test_a_constraint_no_text_matches_is_a_request_error(tiny_checkpoints):
    """A grammar whose language is empty would mask every token: refused."""
    from gemma4serve.structured.grammar import GrammarCompiler
    from gemma4serve.tokenizer import Tokenizer
    from gemma4serve.validation import RequestError

    tokenizer = Tokenizer.from_dir(tiny_checkpoints.get("dense"))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids))
    for spec in (
        StructuredOutputsParams(grammar="root ::= root"),
        StructuredOutputsParams(regex="[^\\s\\S]"),
    ):
        with pytest.raises(RequestError, match="matches no text"):
            compiler.matcher(spec)
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")  # vLLM's list, hashable


@pytest.mark.parametrize(
    "response_format, words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "xml"}, "xml"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
            "schema",
        ),
        *(
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, words)
            for schema, words in [
                ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum greater than maximum"),
                ({"type": "string", "minLength": 5, "maxLength": 2}, "greater than maxLength"),
                # xgrammar drops the lengths beside a pattern, and writes nothing for a range
                # without a decimal of 6 fraction digits: both refused
                ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "pattern with"),
                ({"type": "number", "minimum": 1e-9, "maximum": 1e-8}, "no number"),
            ]
        ),
    ],
)
def test_bad_schema_is_a_400(server, response_format, words):
    body = {"model": MODEL, "messages": HI, "response_format": response_format}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and words in error["message"]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    likes_tea: bool


def test_openai_parse_with_pydantic(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=HI, max_tokens=MAX_TOKENS, seed=5, response_format=Person
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 6


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_mtp_gives_the_same_constrained_tokens(tiny_checkpoints, variant):
    target = tiny_checkpoints.get(variant)
    assistant = tiny_checkpoints.get_assistant(variant)
    spec = LLM(str(target), draft=str(assistant), device="cpu", dtype="float32", num_draft_tokens=3)
    plain = LLM(str(target), device="cpu", dtype="float32")
    prompts = ["a", "b c d e", "JSON please"]
    free0 = spec.engine.kv_pool_free()
    finished = 0
    for structured in (
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
        StructuredOutputsParams(json_object=True),
    ):
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                max_tokens=200,
                temperature=temperature,
                seed=7,
                structured_outputs=structured,
            )
            with_drafts = spec.generate(prompts, params)
            without = plain.generate(prompts, params)
            assert [o.token_ids for o in with_drafts] == [o.token_ids for o in without]
            for output in with_drafts:
                completion = output.outputs[0]
                if completion.finish_reason == "stop":  # else a string ran to max_tokens
                    check_strict_json(completion.text)
                    finished += 1
    assert finished >= 6
    assert spec.engine.snapshot().spec_drafted_tokens > 0
    assert spec.engine.kv_pool_free() == free0


# A second schema, so that one batch holds several grammars.
TAGS = {
    "type": "array",
    "items": {"enum": ["alpha", "beta", "gamma"]},
    "minItems": 1,
    "maxItems": 4,
}
WEATHER_TOOL = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    """Requests with different grammars (two schemas, json_object, a forced tool call) and none,
    greedy and seeded, of different lengths: sequences end at different steps of one batch."""

    def params(structured=None, **kw):
        kw = {"max_tokens": 120, "temperature": 0.0, **kw}
        return SamplingParams(structured_outputs=structured, **kw)

    batch = [
        ("a", params(StructuredOutputsParams(json=json.dumps(SCHEMA)))),
        ("b c d e", params(StructuredOutputsParams(json_object=True), max_tokens=50)),
        ("JSON please", params(StructuredOutputsParams(json=json.dumps(TAGS)))),
        ("weather?", params(StructuredOutputsParams(tool_calls=json.dumps([WEATHER_TOOL])))),
        ("free text", params(max_tokens=40, ignore_eos=True)),
        ("f g", params(temperature=1.0, seed=4, max_tokens=70, ignore_eos=True)),
        ("h", params(StructuredOutputsParams(json=json.dumps(SCHEMA)), temperature=1.0, seed=3)),
    ]
    return [prompt for prompt, _ in batch], [p for _, p in batch]


@pytest.mark.parametrize("drafter", [True, False])
def test_async_scheduling_changes_no_constrained_output(tiny_checkpoints, drafter):
    """Constrained steps continued on the device (their masks filled after the step before them
    is committed) give the synchronous engine's tokens, and every finished output validates."""
    target = tiny_checkpoints.get("dense")
    draft = str(tiny_checkpoints.get_assistant("dense")) if drafter else None
    kw = dict(draft=draft, device="cpu", dtype="float32", num_draft_tokens=3)
    on = LLM(str(target), **kw)
    off = LLM(str(target), async_scheduling=False, **kw)
    prompts, params = mixed_batch()
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert on.engine.num_continued_steps > 0 and off.engine.num_continued_steps == 0
    texts = [o.outputs[0].text for o in got]
    reasons = [o.outputs[0].finish_reason for o in got]
    jsonschema.validate(check_strict_json(texts[0]), SCHEMA)
    assert reasons[1] == "length" or isinstance(check_strict_json(texts[1]), dict)
    jsonschema.validate(check_strict_json(texts[2]), TAGS)
    assert reasons[3] == "stop" and texts[3].startswith("call:get_weather{")
    jsonschema.validate(check_strict_json(texts[6]), SCHEMA)
    assert reasons[4:6] == ["length", "length"]
    assert on.engine.kv_pool_free() == on.engine.kv.pool.capacity


def test_a_constrained_decode_batch_is_continued(tiny_checkpoints):
    """A json_object request alone: its decode steps are queued before the step before is read."""
    llm = LLM(str(tiny_checkpoints.get("dense")), device="cpu", dtype="float32")
    params = SamplingParams(
        max_tokens=48,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    (out,) = llm.generate(["JSON please"], params)
    assert len(out.outputs[0].token_ids) > 30
    assert llm.engine.num_continued_steps >= len(out.outputs[0].token_ids) - 3
