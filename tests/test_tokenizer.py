"""Tokenizer: byte-fallback round trips, Gemma's special ids, and chat templates rendered like
transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from gemma4serve.demo.tokenizer import SPECIAL_TOKENS
from gemma4serve.tokenizer import Tokenizer

# The chat template published with gemma-4-31B-it (verbatim copy), so the parity test runs
# everywhere.
REFERENCE_TEMPLATE = Path(__file__).parent / "data" / "chat_template.gemma-4-31B-it.jinja"

TEXTS = [
    "Hello world, the quick brown fox!",
    "héllo wörld — ça va? 😀👍🏽 日本語のテキスト 한국어 \u200b",
    "  leading, trailing   and\tmixed\n\nwhitespace  ",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoints.get("dense"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_characters_fall_back_to_bytes(tok):
    ids = tok.encode("😀")  # not in the tiny vocab: four <0xNN> tokens
    assert [tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.decode(ids) == "😀"
    assert "\ufffd" in tok.decode(ids[:2])  # half a character


def test_special_tokens(tok):
    assert tok.vocab_size == 512
    for i, s in SPECIAL_TOKENS.items():
        assert tok.token_to_id(s) == i, s
    assert tok.bos_token_id == 2
    assert tok.eos_token_ids == (1, 106, 50)  # from generation_config.json
    assert {0, 1, 2, 3, 4, 105, 106} <= set(tok.all_special_ids)
    assert tok.encode("<|turn>model\n")[0] == 105
    # BOS comes from the chat template, never from the tokenizer.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.decode([2, 105] + tok.encode("hi") + [106]) == "hi"


def test_encoding_matches_transformers(tiny_checkpoints, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoints.get("dense"))
    assert len(hf) == tok.vocab_size
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text), text
        ids = tok.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


# ---- chat templates -----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "  Hi there!  "}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<|channel>thought\nadd them<channel|>4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}],
        }
    ],
    "tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {
            "role": "tool",
            "content": "",
            "tool_responses": [{"name": "get_weather", "response": {"temp": 21}}],
        },
    ],
}


@pytest.fixture(scope="module")
def reference_dir(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny tokenizer with the published Gemma 4 chat template."""
    if not REFERENCE_TEMPLATE.exists():
        pytest.skip("reference chat template not available")
    d = tmp_path_factory.mktemp("reference-template")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_checkpoints.get("dense") / f, d / f)
    shutil.copy(REFERENCE_TEMPLATE, d / "chat_template.jinja")
    return d


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, False, True], ids=["default", "think-off", "think-on"])
@pytest.mark.parametrize("gen_prompt", [True, False], ids=["gen", "nogen"])
def test_reference_template_matches_transformers(reference_dir, conversation, thinking, gen_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(reference_dir)
    ours = Tokenizer.from_dir(reference_dir)
    messages = CONVERSATIONS[conversation]
    tools = [WEATHER_TOOL] if conversation == "tools" else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen_prompt, **kwargs
    )
    got = ours.apply_chat_template(
        messages, tools=tools, add_generation_prompt=gen_prompt, **kwargs
    )
    assert got == expected
    assert got.startswith("<bos>")
    assert ours.encode(got) == hf(got, add_special_tokens=False)["input_ids"]


def test_demo_template(tok):
    assert tok.apply_chat_template([{"role": "user", "content": " Hi "}]) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel>thought\nhm<channel|>Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(messages, enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello!<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|turn>user\nBye<turn|>\n"
    )
    with_tools = tok.apply_chat_template(
        CONVERSATIONS["tools"][:2] + [{"role": "tool", "name": "get_weather", "content": "21 C"}],
        tools=[WEATHER_TOOL],
    )
    assert with_tools.startswith("<bos><|turn>system\n<|tool>declaration:get_weather{")
    assert '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>' in with_tools
    assert (
        '<|turn>tool\n<|tool_response>response:get_weather{value:<|"|>21 C<|"|>}'
        "<tool_response|><turn|>\n" in with_tools
    )
    with pytest.raises(jinja2.TemplateError, match="system message"):
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


def test_template_environment(tok):
    template = (
        "{{ bos_token }}{{ eos_token }}{{ pad_token }}|{{ messages | tojson }}|"
        "{{ strftime_now('%Y') | length }}"
        "{% generation %}G{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
    )
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], chat_template=template)
    assert (
        out == '<bos><eos><pad>|[{"role": "user", "content": "<é>"}]|4G'
    )  # tojson does not escape
    with pytest.raises(jinja2.TemplateError, match="boom"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # sandboxed
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    # Explicit keyword arguments override the special tokens, as in transformers.
    assert tok.apply_chat_template([], chat_template="{{ bos_token }}", bos_token="X") == "X"


def test_openai_tool_call_arguments_render_as_transformers_renders_a_mapping(reference_dir):
    """An OpenAI client's assistant turn carries `arguments` as a JSON string: the server parses it,
    so the prompt is the one the template writes for the mapping (not the string pasted as is)."""
    from gemma4serve.server.protocol import ChatMessage

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(reference_dir)
    ours = Tokenizer.from_dir(reference_dir)
    arguments = {"city": "Paris, {France}", "days": 3, "metric": True}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    history = [{"role": "user", "content": "Weather in Paris?"}]
    openai_turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {**call, "function": {**call["function"], "arguments": json.dumps(arguments)}}
        ],
    }
    mapping_turn = {
        "role": "assistant",
        "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}],
    }
    messages = [ChatMessage.model_validate(m).to_template() for m in [*history, openai_turn]]
    got = ours.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=False)
    expected = hf.apply_chat_template(
        [*history, mapping_turn], tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=False
    )
    assert got == expected
    assert '"city"' not in got  # the template's notation, not the JSON string


def test_a_long_encode_lets_other_threads_run(tok):
    """Tokenizing a long prompt must not hold the GIL: with it held (tokenizers' `encode`), the
    engine's thread and the event loop stood still for the whole encode (39 s for 30 MB)."""
    import threading

    text = "hello world, this is a sentence. " * 40_000
    ticks, done = [], threading.Event()

    def count():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    encoder = threading.Thread(target=tok.encode, args=(text,))
    encoder.start()
    ticks.clear()  # count only while the encode runs
    encoder.join()
    during = len(ticks)
    done.set()
    counter.join()
    assert during >= 20, f"the other thread ran {during} times during the encode"
