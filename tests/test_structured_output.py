"""Structured output (response_format json_object / json_schema): every output of random tiny
models parses and validates, MTP changes no constrained token, bad schemas get a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_server_real import MODEL, free_pages, start_server, wait_for_free_pages

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


def test_json_schema_outputs_validate_over_seeds(server, client):
    free0 = free_pages(server)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=MAX_TOKENS,
            seed=seed,
            temperature=1.5,
            response_format=response_format,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # ended by the grammar
        jsonschema.validate(check_strict_json(choice.message.content), SCHEMA)
    wait_for_free_pages(server, free0)


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
    "response_format, words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "xml"}, "xml"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
            "schema",
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
