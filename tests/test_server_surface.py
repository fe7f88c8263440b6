"""The vLLM-compatible surface of the real server: the flags and endpoints vLLM users reach for.

Real servers (the tiny demo Gemma 4 on CPU, as in test_server_real.py) started with the flags
under test, talked to with httpx and the official `openai` client."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from fake_engine import ServerProcess, free_pages, sse_data

pytestmark = [pytest.mark.timeout(300)]

API_KEY = "sesame"
ORIGIN = "http://app.example"
HI = [{"role": "user", "content": "Tell me a story about the sea."}]


def start(*args: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        [
            "-m",
            "gemma4serve.cli",
            *args,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--max-model-len",
            "1024",
            "--num-draft-tokens",
            "3",
        ],
        ready_timeout=240,
        env=env,
    )


@pytest.fixture(scope="module")
def server(demo_root):
    """The model given positionally, as `vllm serve MODEL`, with auth, CORS, a root path, a
    logprobs cap and request logging."""
    _, target, assistant = demo_root
    with start(
        str(target),
        "--draft",
        str(assistant),
        "--served-model-name",
        "tiny",
        "--api-key",
        API_KEY,
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--root-path",
        "/gemma",
        "--max-logprobs",
        "5",
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
    ) as proc:
        yield proc


@pytest.fixture
def base(server) -> str:
    return server.url


def auth(**headers) -> dict:
    return {"Authorization": f"Bearer {API_KEY}", **headers}


def test_routes_answer_with_the_prefix_stripped_as_a_proxy_does(base):
    r = httpx.get(base + "/v1/models", headers=auth(), timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    # the gate sees the route's path: /v1 under the root path still needs the key
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401


def test_openapi_describes_the_real_request_models(server, base):
    doc = httpx.get(base + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1") and doc["servers"] == [{"url": "/gemma"}]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    schemas = doc["components"]["schemas"]
    fields = schemas["ChatCompletionRequest"]["properties"]
    for name in ("messages", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words"):
        assert name in fields
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert "echo" in schemas["CompletionRequest"]["properties"]
    assert {"/tokenize", "/detokenize", "/v1/completions", "/health"} <= doc["paths"].keys()

    def refs(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for target in refs(doc):  # every reference resolves
        assert target.removeprefix("#/components/schemas/") in schemas, target
    page = httpx.get(base + "/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '"/gemma/openapi.json"' in page.text


def test_tokenize_and_detokenize(server, base):
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = httpx.post(base + "/tokenize", json={"model": "tiny", "prompt": "Hello there"}, timeout=30)
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"] is None
    completion = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=1, temperature=0
    )
    assert completion.usage.prompt_tokens == body["count"]
    with_strs = httpx.post(
        base + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True}, timeout=30
    ).json()
    assert with_strs["token_strs"][0] == "<bos>" and len(with_strs["token_strs"]) == body["count"]
    plain = httpx.post(
        base + "/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}, timeout=30
    ).json()
    assert plain["tokens"] == body["tokens"][1:]
    text = httpx.post(base + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert text == {"prompt": "<bos>Hello there"}

    chat = httpx.post(base + "/tokenize", json={"messages": HI}, timeout=30).json()
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens

    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = httpx.post(base + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404


def test_continue_final_message(base):
    messages = HI + [{"role": "assistant", "content": "Once upon a time"}]
    cont = httpx.post(
        base + "/tokenize",
        json={"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
        timeout=30,
    ).json()
    closed = httpx.post(
        base + "/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=30
    ).json()
    detok = [
        httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}, timeout=30).json()["prompt"]
        for t in (cont, closed)
    ]
    assert detok[0].endswith("Once upon a time")
    assert detok[1].startswith(detok[0]) and len(detok[1]) > len(detok[0])  # the turn is closed
    both = httpx.post(
        base + "/v1/chat/completions",
        headers=auth(),
        json={"messages": messages, "continue_final_message": True, "max_tokens": 2},
        timeout=30,
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    reply = httpx.post(
        base + "/v1/chat/completions",
        headers=auth(),
        json={
            "messages": messages,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 2,
        },
        timeout=60,
    ).json()
    assert reply["usage"]["prompt_tokens"] == cont["count"]


def test_x_request_id_is_echoed_and_names_the_request(server, base):
    r = httpx.post(
        base + "/v1/chat/completions",
        headers=auth(**{"X-Request-Id": "trace-42"}),
        json={"messages": HI, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    # also on refusals and other routes
    refused = httpx.get(base + "/v1/models", headers={"X-Request-Id": "t-1"}, timeout=30)
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "t-1"
    # without one, the generated id is sent
    r = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.headers["x-request-id"] == r.json()["id"]
    # --enable-log-requests: the request was logged under its id
    assert any("Received request chatcmpl-trace-42" in line for line in server.lines)


def test_cors_preflight_passes_auth_and_names_the_origin(base):
    preflight = httpx.options(
        base + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
        timeout=30,
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(
        base + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(base + "/v1/models", headers=auth(Origin=ORIGIN), timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_max_logprobs_caps_what_a_request_may_ask(base):
    def chat(top: int) -> httpx.Response:
        return httpx.post(
            base + "/v1/chat/completions",
            headers=auth(),
            json={"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": top},
            timeout=60,
        )

    refused = chat(6)
    assert refused.status_code == 400 and "--max-logprobs" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "top_logprobs"
    content = chat(5).json()["choices"][0]["logprobs"]["content"]
    assert len(content[0]["top_logprobs"]) == 5
    completion = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": "Hi", "max_tokens": 2, "logprobs": 6},
        timeout=60,
    )
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "logprobs"


def test_truncate_prompt_tokens_keeps_the_prompt_end(base):
    prompt = " ".join(["word"] * 40)

    def usage(**extra) -> int:
        r = httpx.post(
            base + "/v1/completions",
            headers=auth(),
            json={"prompt": prompt, "max_tokens": 1, **extra},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert usage() > 10
    assert usage(truncate_prompt_tokens=5) == 5
    refused = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": prompt, "truncate_prompt_tokens": 5000},
        timeout=60,
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "truncate_prompt_tokens"


# --------------------------------------------------------------------------------------------------
# Flags that need a server of their own


def _hub_cache_with(target, cache, repo: str) -> None:
    """A Hugging Face cache under `cache` that holds `target` as `repo`'s main snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    shutil.copytree(target, snapshot)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_override_generation_config_sits_over_the_checkpoints(demo_root):
    """vLLM's --override-generation-config: its settings over the checkpoint's defaults (the
    demo's temperature 1.0 becomes 0 here, so a request that says nothing is greedy)."""
    _, target, assistant = demo_root
    override = '{"temperature": 0.0}'
    with start(
        str(target), "--draft", str(assistant), "--override-generation-config", override
    ) as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kwargs = dict(model=client.models.list().data[0].id, prompt="The sea", max_tokens=12)
        defaulted = client.completions.create(**kwargs, n=3)
        greedy = client.completions.create(**kwargs, temperature=0)
        assert {c.text for c in defaulted.choices} == {greedy.choices[0].text}
        sampled = client.completions.create(**kwargs, n=3, temperature=1.0, seed=1)
        assert len({c.text for c in sampled.choices}) > 1


def test_download_dir_generation_config_and_chat_template(demo_root, tmp_path):
    """A Hub id found offline in --download-dir; defaults from a --generation-config folder
    (temperature 0: greedy unless the request asks otherwise); an inline --chat-template; uvicorn
    at its default level logs each request; --disable-log-requests (vLLM's) is taken and requests
    are not logged."""
    _, target, assistant = demo_root
    _hub_cache_with(target, tmp_path / "hub", "test-org/tiny")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with start(
        "test-org/tiny",
        "--draft",
        str(assistant),
        "--download-dir",
        str(tmp_path / "hub"),
        "--generation-config",
        str(tmp_path / "gen"),
        "--chat-template",
        template,
        "--disable-log-requests",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-home")},
    ) as proc:
        assert proc.ready_lines()[0].endswith("(model test-org/tiny)")
        tokens = httpx.post(
            proc.url + "/tokenize", json={"messages": [{"role": "user", "content": "hey"}]}
        ).json()["tokens"]
        text = httpx.post(proc.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert text == "<bos>[hey]"
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kwargs = dict(model="test-org/tiny", prompt="The sea", max_tokens=12)
        defaulted = client.completions.create(**kwargs, n=3)
        greedy = client.completions.create(**kwargs, temperature=0)
        assert {c.text for c in defaulted.choices} == {greedy.choices[0].text}
        assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in proc.lines)
        assert not any("Received request" in line for line in proc.lines)


def _self_signed(tmp_path) -> tuple[str, str]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(key), str(cert)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
def test_https_with_ssl_files_and_a_quiet_uvicorn(demo_root, tmp_path):
    _, target, _ = demo_root
    key, cert = _self_signed(tmp_path)
    with start(
        "--model",
        str(target),
        "--ssl-keyfile",
        key,
        "--ssl-certfile",
        cert,
        "--uvicorn-log-level",
        "warning",
        "--generation-config",
        "vllm",
    ) as proc:
        assert proc.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=cert)
        r = httpx.get(proc.url + "/health", verify=trusted, timeout=30)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(proc.url.replace("https://", "http://") + "/health", timeout=30)
        httpx.post(
            proc.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            verify=trusted,
            timeout=60,
        )
        assert not any("HTTP/1.1" in line for line in proc.lines)  # no access lines at warning


def test_cli_model_given_twice_is_an_error(capsys):
    from gemma4serve.cli import parse_args

    assert parse_args(["some/model"]).model == "some/model"
    assert parse_args(["--model", "some/model"]).model == "some/model"
    with pytest.raises(SystemExit):
        parse_args(["one/model", "--model", "other/model"])
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["m", "--ssl-keyfile", "k.pem"])
    assert "go together" in capsys.readouterr().err
    # vLLM's text-only recipe flags are accepted; a multimodal limit is refused.
    parse_args(["m", "--trust-remote-code", "--kv-cache-dtype", "auto"])
    with pytest.raises(SystemExit):
        parse_args(["m", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    for text_only in ('{"image": 0, "audio": 0}', '{"image": {"count": 0}}'):
        parse_args(["m", "--enable-chunked-prefill", "--limit-mm-per-prompt", text_only])
    for limits, message in [
        ('{"image": 4, "audio": 1}', "this server serves text only"),
        ('{"image": {"count": 2}}', "this server serves text only"),
        ("[0]", "expected a JSON object"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["m", "--limit-mm-per-prompt", limits])
        assert message in capsys.readouterr().err
    for timeout in ("nan", "inf", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["m", "--engine-iteration-timeout", timeout])
        assert "expected a number of seconds" in capsys.readouterr().err
    kwargs = parse_args(["m", "--default-chat-template-kwargs", '{"enable_thinking": true}'])
    assert kwargs.default_chat_template_kwargs == {"enable_thinking": True}
    for given, message in [("[1]", "expected a JSON object"), ('{"tools": []}', "may not set")]:
        with pytest.raises(SystemExit):
            parse_args(["m", "--default-chat-template-kwargs", given])
        assert message in capsys.readouterr().err


def test_cli_speculative_config_is_vllms_spelling_of_the_assistant(capsys):
    from gemma4serve.cli import parse_args

    def parsed(config, *flags):
        ns = parse_args(["m", "--speculative-config", json.dumps(config), *flags])
        return ns.draft, ns.num_draft_tokens

    assert parsed({"method": "mtp", "model": "a", "num_speculative_tokens": 2}) == ("a", 2)
    assert parsed({"model": "a"}) == ("a", 4)
    assert parsed({"model": "a"}, "--num-draft-tokens", "3") == ("a", 3)
    assert parsed({"model": "a", "num_speculative_tokens": 3}, "--draft", "a") == ("a", 3)
    refused = [
        ([], "expected a JSON object"),
        (None, "expected a JSON object"),
        ({"method": "ngram", "model": "a"}, "method 'ngram' not supported"),
        ({"model": "a", "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size not"),
        ({"num_speculative_tokens": 2}, 'assistant checkpoint as "model"'),
        ({"model": "a", "num_speculative_tokens": 0}, "positive integer"),
        ({"model": "a", "num_speculative_tokens": True}, "positive integer"),
        ({"model": "a", "num_speculative_tokens": 2.0}, "positive integer"),
    ]
    for config, message in refused:
        with pytest.raises(SystemExit):
            parsed(config)
        assert message in capsys.readouterr().err, config
    for flags, message in [
        (["--draft", "b"], "assistant is given twice"),
        (["--num-draft-tokens", "3"], "draft count is given twice"),
    ]:
        with pytest.raises(SystemExit):
            parsed({"model": "a", "num_speculative_tokens": 2}, *flags)
        assert message in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        parse_args(["--demo", "--speculative-config", '{"model": "a"}'])
    assert "--demo serves the built-in" in capsys.readouterr().err


def test_help_reads_cleanly():
    from gemma4serve.cli import build_parser

    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == "==SUPPRESS==":
            continue
        assert action.help, f"{action.option_strings} has no help"
        text = formatter._get_help_string(action)
        assert text.count("(default:") <= 1, f"{action.option_strings}: {text}"
    text = parser.format_help()
    assert "default: None" not in text and "default: False" not in text


# --------------------------------------------------------------------------------------------------
# Token rules: vLLM's logit_bias, allowed_token_ids, bad_words, min_tokens act on real outputs

FOX = "The quick brown fox"


def complete(base, **body) -> list[dict]:
    r = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={
            "prompt": FOX,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
            **body,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_logit_bias_steers_greedy_choices(base):
    greedy = complete(base)[0]["token_ids"]
    favoured = next(t for t in range(77, 512) if t not in greedy)
    biased = complete(base, logit_bias={str(favoured): 100})[0]
    assert biased["token_ids"] == [favoured] * 16
    avoided = complete(base, logit_bias={str(greedy[0]): -100})[0]["token_ids"]
    assert avoided[0] != greedy[0]
    chat = httpx.post(
        base + "/v1/chat/completions",
        headers=auth(),
        json={
            "messages": HI,
            "max_tokens": 16,
            "temperature": 0,
            "logit_bias": {str(favoured): 100},
        },
        timeout=120,
    ).json()
    assert chat["choices"][0]["message"]["content"] == biased["text"]
    refused = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": FOX, "logit_bias": {"100000": 5}},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"


def test_allowed_token_ids_bound_sampled_choices(base):
    allowed = {5, 77, 300}
    choices = complete(base, temperature=1.0, n=3, seed=7, allowed_token_ids=sorted(allowed))
    for choice in choices:
        assert set(choice["token_ids"]) <= allowed and len(choice["token_ids"]) == 16


def test_bad_words_never_appear(base):
    greedy = complete(base)[0]
    assert "ing" in greedy["text"]  # the demo model's greedy text, from which words are banned
    banned = complete(base, bad_words=["ing"])[0]
    assert "ing" not in banned["text"] and banned["token_ids"][:12] == greedy["token_ids"][:12]
    # a word of two tokens ("}" twice): its second token never follows its first
    pairs = list(zip(greedy["token_ids"], greedy["token_ids"][1:]))
    (brace,) = httpx.post(
        base + "/tokenize", json={"prompt": "}", "add_special_tokens": False}, timeout=30
    ).json()["tokens"]
    assert (brace, brace) in pairs
    two = complete(base, bad_words=["}}"])[0]["token_ids"]
    assert (brace, brace) not in list(zip(two, two[1:])) and brace in two


def test_min_tokens_holds_back_stop_tokens(base):
    first = complete(base)[0]["token_ids"][0]
    stopped = complete(base, stop_token_ids=[first])[0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = complete(base, stop_token_ids=[first], min_tokens=5)[0]
    assert len(held["token_ids"]) >= 5 and first not in held["token_ids"][:5]
    refused = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": FOX, "max_tokens": 2, "min_tokens": 3},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"


# --------------------------------------------------------------------------------------------------
# Batched prompts on /v1/completions


def test_batched_prompts_are_indexed_prompt_major(server, base):
    prompts = [FOX, "Once upon a time"]
    idle = free_pages(server)
    singles = [complete(base, prompt=p, max_tokens=8)[0] for p in prompts]
    r = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0, "echo": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice in body["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"] == prompt + singles[choice["index"] // 2]["text"]
    single_usage = [
        httpx.post(
            base + "/v1/completions",
            headers=auth(),
            json={"prompt": p, "max_tokens": 8, "temperature": 0},
            timeout=120,
        ).json()["usage"]
        for p in prompts
    ]
    assert body["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in single_usage)
    assert body["usage"]["completion_tokens"] == 2 * sum(
        u["completion_tokens"] for u in single_usage
    )

    ids = [
        s["prompt_token_ids"] for s in (complete(base, prompt=p, max_tokens=1)[0] for p in prompts)
    ]
    by_ids = complete(base, prompt=ids, max_tokens=8)
    assert [c["token_ids"] for c in by_ids] == [s["token_ids"] for s in singles]
    assert [c["prompt_token_ids"] for c in by_ids] == ids

    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    streamed: dict[int, str] = {}
    finishes: list[int] = []
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=8, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.append(choice.index)
    assert sorted(finishes) == [0, 1, 2, 3]
    assert streamed == {i: singles[i // 2]["text"] for i in range(4)}
    assert free_pages(server) == idle


def test_a_refused_prompt_fails_the_whole_batch(base):
    r = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": [FOX, [1, 2, 10**6]], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    empty = httpx.post(
        base + "/v1/completions", headers=auth(), json={"prompt": [FOX, ""]}, timeout=60
    )
    assert empty.status_code == 400


# --------------------------------------------------------------------------------------------------
# Prompt logprobs, and echo with logprobs


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(base):
    """vLLM's return_tokens_as_token_ids: tokens that decode alike (byte-fallback pieces all show
    as U+FFFD) stay apart, so a greedy token is found in its own top logprobs."""
    body = {"prompt": FOX, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    body["return_tokens_as_token_ids"] = True
    body["return_token_ids"] = True
    r = httpx.post(base + "/v1/completions", headers=auth(), json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert token in top and top[token] == max(top.values())
    chat = {"messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True}
    chat |= {"top_logprobs": 2, "return_tokens_as_token_ids": True}
    r = httpx.post(base + "/v1/chat/completions", headers=auth(), json=chat, timeout=120)
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:")
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["token"] == entry["top_logprobs"][0]["token"]


def test_prompt_logprobs_score_each_prompt_token(base):
    def request(**body) -> dict:
        r = httpx.post(
            base + "/v1/completions",
            headers=auth(),
            json={"prompt": FOX, "max_tokens": 2, "temperature": 0, **body},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()

    body = request(prompt_logprobs=2, return_token_ids=True)
    ids = body["choices"][0]["prompt_token_ids"]
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) == body["usage"]["prompt_tokens"] and scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i]
        assert str(ids[i]) in entry and len(entry) <= 3
        best = sorted(entry.values(), key=lambda e: e["rank"])[0]
        assert best["rank"] == 1 and best["logprob"] >= entry[str(ids[i])]["logprob"]
    # the oracle: the logprobs the server gives the first generated token after each prefix
    for i in (1, len(ids) - 1):
        after = request(prompt=ids[:i], max_tokens=1, logprobs=2)["choices"][0]["logprobs"]
        expected = sorted(after["top_logprobs"][0].values(), reverse=True)[:2]
        got = sorted((e["logprob"] for e in scored[i].values() if e["rank"] <= 2), reverse=True)
        assert got == pytest.approx(expected, abs=1e-3)
    # prefix caching does not skip the scoring of a repeated prompt
    assert request(prompt_logprobs=2)["choices"][0]["prompt_logprobs"] == scored

    echoed = request(echo=True, logprobs=1)["choices"][0]
    logprobs = echoed["logprobs"]
    assert echoed["text"].startswith(FOX)
    assert len(logprobs["tokens"]) == len(ids) + 2 and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1] == pytest.approx(scored[1][str(ids[1])]["logprob"])
    assert logprobs["text_offset"][len(ids)] == len(FOX)  # the completion starts after the echo

    # vLLM's echo without generation (max_tokens 0, as prompt-scoring clients send): the prompt
    # and its logprobs alone, streamed or not
    scored_only = request(echo=True, logprobs=1, max_tokens=0)
    (choice,) = scored_only["choices"]
    assert choice["text"] == FOX and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == logprobs["tokens"][: len(ids)]
    assert choice["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][: len(ids)]
    assert scored_only["usage"]["completion_tokens"] == 0
    body = {"prompt": FOX, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", base + "/v1/completions", headers=auth(), json=body, timeout=120
    ) as r:
        chunks = [json.loads(p) for p in sse_data(r.iter_lines())[:-1]]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in streamed) == FOX
    assert [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]] == choice[
        "logprobs"
    ]["tokens"]
    assert streamed[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 0

    chat = httpx.post(
        base + "/v1/chat/completions",
        headers=auth(),
        json={"messages": HI, "max_tokens": 2, "prompt_logprobs": 0},
        timeout=120,
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # just the prompt's token

    with httpx.stream(
        "POST",
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": FOX, "max_tokens": 2, "prompt_logprobs": 2, "stream": True},
        timeout=120,
    ) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[5:])
    assert first["choices"][0]["prompt_logprobs"] == scored

    too_many = httpx.post(
        base + "/v1/completions",
        headers=auth(),
        json={"prompt": FOX, "prompt_logprobs": 6},
        timeout=60,
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_min_tokens_holds_back_stop_strings(base):
    greedy = complete(base)[0]
    stop = greedy["text"][-2:]  # written by the last tokens of the greedy run
    first_stop = greedy["text"].index(stop)
    stopped = complete(base, stop=[stop])[0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == greedy["text"][:first_stop]
    held = complete(base, stop=[stop], min_tokens=15)[0]
    assert len(held["token_ids"]) >= 15 and held["text"].startswith(greedy["text"][:first_stop])
    assert len(held["text"]) > len(stopped["text"])


def test_batched_prompts_get_their_own_prompt_logprobs(base):
    prompts = [FOX, "Once upon a time"]

    def choices(prompt, **body) -> list[dict]:
        r = httpx.post(
            base + "/v1/completions",
            headers=auth(),
            json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    singles = [choices(p, prompt_logprobs=1, echo=True, logprobs=1)[0] for p in prompts]
    batch = choices(prompts, n=2, prompt_logprobs=1, echo=True, logprobs=1)
    for choice in batch:
        single = singles[choice["index"] // 2]
        assert len(choice["prompt_logprobs"]) == len(single["prompt_logprobs"])
        for got, expected in zip(choice["prompt_logprobs"][1:], single["prompt_logprobs"][1:]):
            assert got.keys() == expected.keys()  # scored in another batch: equal up to rounding
            for token, entry in got.items():
                assert entry["logprob"] == pytest.approx(expected[token]["logprob"], abs=1e-4)
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"]
        assert len(choice["prompt_logprobs"]) < len(single["logprobs"]["tokens"])
