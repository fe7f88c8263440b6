"""The HTTP layer: an OpenAI-compatible Starlette app over one engine.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming or one JSON body),
GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /health, GET /metrics,
GET /version, GET /openapi.json, GET /docs. Every refusal is
OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx (503 while starting or draining).

Where work runs: templating and tokenization go to the thread pool, /metrics reads
`engine.stats()` there too; the engine's own work happens on its thread. The event loop only
validates, awaits outputs and writes bytes. A generation is watched for client disconnect for its
whole life (waiting in the queue included): on disconnect its task is cancelled, the engine's
async generator is closed and the request is aborted, so its KV pages go back to the pools.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gemma4serve.chat.output import ChatMarkers
from gemma4serve.engine.client import EngineClient
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.server.batch import merged_outputs
from gemma4serve.server.drain import drain_when_asked
from gemma4serve.server.formats import ChatFormat, CompletionFormat, Prompt, ResponseFormat
from gemma4serve.server.limits import RequestLimits, read_body, read_request
from gemma4serve.server.metrics import ServerMetrics
from gemma4serve.server.openapi import docs_page, openapi_document
from gemma4serve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseHeader,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenStrings,
    error_body,
    load_json_object,
    validate_request,
)
from gemma4serve.stop_strings import StopStrings
from gemma4serve.validation import (
    RequestError,
    check_context_length,
    check_token_ids,
    encode_text,
    with_bos,
)

logger = logging.getLogger("gemma4serve.server")

# Template variables the request must not override: they are set from the request's own fields.
RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
}
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_REQUEST_ID_CHARS = 256  # a longer X-Request-Id is replaced by a generated one


def _dumps(obj) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (
        UnicodeEncodeError
    ):  # a lone surrogate from the request (echoed in a message): \u-escape it
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _json(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(
        _dumps(body), status_code=status, media_type="application/json", headers=headers
    )


# ------------------------------------------------------------------------------------------------
# Server state


@dataclass
class CorsSettings:
    """vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerState:
    """What the routes share: the engine, the served names, the server's lifecycle switches."""

    engine: EngineClient
    model_names: list[str]
    api_key: str | None
    metrics: ServerMetrics
    token_strings: TokenStrings
    chat_markers: ChatMarkers | None  # the tokenizer's channel and tool-call tokens, if any
    sampling_defaults: dict
    drain_timeout: float
    limits: RequestLimits
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1 = no cap
    log_requests: bool = False  # one log line per request: its id, prompt size and settings
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag: such prompts get no tools
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False  # the engine thread runs
    draining: bool = False  # shutting down: refuse new work, let running requests finish
    inflight: set[str] = field(
        default_factory=set
    )  # request ids being generated (touched on the loop only)
    on_drained: Callable[[], None] | None = None  # called once the drain is over (server/drain.py)
    _engine_stopped: bool = False
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)

    def unavailable(self) -> str | None:
        """Why new work is refused (503), or None when the server takes requests."""
        if self.draining:
            return "The server is shutting down."
        if not self.ready:
            return "The engine is not ready yet."
        if not self.engine.ready:  # the engine died: fail fast, never hang a client
            return "The engine is not running."
        return None

    def begin_drain(self) -> None:
        """Stop admitting requests (503) and fail health checks; safe in a signal handler."""
        self.draining = True

    def abort_inflight(self) -> None:
        """Abort every running request: the engine ends each with finish_reason "abort", so that
        streams still close with a final chunk and [DONE]."""
        for request_id in list(self.inflight):
            self.engine.abort(request_id)

    def stop_engine(self, drain_timeout: float | None = None) -> None:
        """engine.shutdown(), once, whoever asks first (the app's shutdown, or the CLI after a
        forced exit)."""
        with self._stop_lock:
            if self._engine_stopped:
                return
            self._engine_stopped = True
        self.ready = False
        self.engine.shutdown(
            drain_timeout=self.drain_timeout if drain_timeout is None else drain_timeout
        )

    def resolve_model(self, requested: str | None) -> str:
        if requested is None:  # vLLM accepts a request without "model"
            return self.model_names[0]
        if requested not in self.model_names:
            raise ApiError(
                404,
                f"The model `{requested}` does not exist. This server serves: "
                f"{', '.join(self.model_names)}.",
                param="model",
                code="model_not_found",
            )
        return requested

    def model_card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "gemma4serve",
            "root": self.engine.model_name,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }


def _state(request: Request) -> ServerState:
    return request.app.state.gemma4serve


# ------------------------------------------------------------------------------------------------
# Gate: auth and draining for /v1 (pure ASGI, so that it never buffers a stream)


class ApiGate:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self._key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope, receive, send):
        # A CORS preflight (OPTIONS) carries no credentials: CORSMiddleware answers it before this.
        if scope["type"] == "http" and _route_path(scope).startswith("/v1"):
            if scope["method"] == "OPTIONS":
                await self.app(scope, receive, send)
                return
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Response | None:
        if self._key is not None:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                message = (
                    "Incorrect API key provided." if auth else "You didn't provide an API key."
                )
                return _json(
                    401, error_body(message, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"}
                )
        unavailable = self.state.unavailable()
        if unavailable:
            return _json(503, error_body(unavailable, type="service_unavailable"))
        return None


def _route_path(scope) -> str:
    """The path the routes see: behind --root-path, uvicorn puts the prefix in front of it."""
    root = scope.get("root_path", "")
    path = scope["path"]
    return path[len(root) :] if root and path.startswith(root) else path


def _given_request_id(scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value if 0 < len(value) <= MAX_REQUEST_ID_CHARS else None
    return None


class RequestIdHeader:
    """Echoes a request's X-Request-Id header in its response, as vLLM does (generation
    responses send their request id whether or not one was given)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        given = _given_request_id(scope) if scope["type"] == "http" else None
        if given is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() != b"x-request-id"
                ]
                message = {**message, "headers": headers + [(b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# ------------------------------------------------------------------------------------------------
# One generation as an ASGI response


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]


class GenerationResponse:
    """Runs one request on the engine and writes it out, streamed (SSE) or as one JSON body.

    The status is chosen only after the engine accepted the request (its first output): a
    ValueError from `generate` (prompt too long, ...) is still a 400. Uvicorn's send() silently
    drops writes to a gone client, so disconnects are watched on receive(), concurrently, for the
    whole generation."""

    def __init__(
        self,
        state: ServerState,
        fmt: ResponseFormat,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stream: bool,
    ):
        self.state = state
        self.fmt = fmt
        self.request_id = request_id
        self.prompts = prompts
        self.params = params  # per prompt
        # The engine's request ids: the response's own, or one per prompt of a batch
        self.engine_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        self.stream = stream
        self._started = False  # response headers sent
        self._engine_finished = False  # the engine sent its finished output (nothing left to abort)
        self._stopped_short = False  # the engine's generator ended without a finished output

    async def __call__(self, scope, receive, send) -> None:
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                logger.info("request %s: client disconnected, aborting", self.request_id)
        except asyncio.CancelledError:
            # uvicorn's graceful-shutdown backstop: the engine did not end this request after the
            # drain abort.
            logger.warning("request %s: cancelled at shutdown", self.request_id)
        finally:
            work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)

    async def _start(self, send, status: int, headers: list) -> None:
        self._started = True
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers + [(b"x-request-id", self.request_id.encode())],
            }
        )

    async def _send_json(self, send, status: int, body: dict) -> None:
        await self._start(send, status, [(b"content-type", b"application/json")])
        await send({"type": "http.response.body", "body": _dumps(body)})

    async def _run(self, send) -> None:
        engine = self.state.engine
        outputs = None
        self.state.inflight.update(self.engine_ids)
        try:
            try:
                streams = [
                    engine.generate(prompt, params, engine_id)
                    for prompt, params, engine_id in zip(self.prompts, self.params, self.engine_ids)
                ]
                outputs = (
                    streams[0]
                    if len(streams) == 1
                    else merged_outputs(streams, self.params[0].n, self.request_id)
                )
                first = await outputs.__anext__()
            except RequestError as e:  # the engine's word on a request, before anything ran
                await self._send_json(send, 400, error_body(str(e), param=e.param, code=e.code))
                return
            except ValueError as e:  # sampling settings the engine refused
                await self._send_json(send, 400, error_body(str(e)))
                return
            if self.stream:
                await self._stream(send, first, outputs)
            else:
                await self._collect(send, first, outputs)
        except Exception as e:
            unavailable = None if self._started else self.state.unavailable()
            if unavailable:  # raced with shutdown: the engine stopped admitting
                await self._send_json(
                    send, 503, error_body(unavailable, type="service_unavailable")
                )
                return
            logger.exception("request %s failed", self.request_id)
            body = error_body(
                f"internal error: {type(e).__name__}: {e}", type="internal_server_error"
            )
            if not self._started:
                await self._send_json(send, 500, body)
            # mid-stream: the status is gone; tell the client in-band, as vLLM does, then end the
            # stream
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + _dumps(body) + b"\n\ndata: [DONE]\n\n",
                    }
                )
        finally:
            self.state.inflight.difference_update(self.engine_ids)
            if outputs is not None:
                try:
                    await (
                        outputs.aclose()
                    )  # GeneratorExit in the engine's generator: it aborts and frees pages
                except Exception:
                    logger.exception(
                        "request %s: closing the engine's generator failed", self.request_id
                    )
            if not self._engine_finished:
                try:
                    for engine_id in self.engine_ids:  # idempotent; covers a generator that
                        engine.abort(engine_id)  # did not abort itself
                except Exception:
                    logger.exception("request %s: abort failed", self.request_id)

    async def _next(self, outputs, previous: RequestOutput) -> RequestOutput:
        """The engine's next output. Should the engine stop without a finished one, the request
        ends as aborted rather than as an error: the client still gets a well-formed end."""
        output = await anext(outputs, None)
        if output is None:
            logger.warning(
                "request %s: the engine stopped without a finished output", self.request_id
            )
            self._stopped_short = True
            return _ended_as_abort(previous)
        return output

    def _finish(self, output: RequestOutput) -> None:
        self._engine_finished = output.finished and not self._stopped_short
        if self._engine_finished:
            self.state.metrics.observe_finished(output)

    async def _stream(self, send, output: RequestOutput, outputs) -> None:
        await self._start(send, 200, SSE_HEADERS)
        events = self.fmt.opening(output)
        while True:
            events += self.fmt.step(output)
            if events:  # one write per engine output: MTP can bring several tokens at once
                await send({"type": "http.response.body", "body": _sse(events), "more_body": True})
                events = []
            if output.finished:
                break
            output = await self._next(outputs, output)
        self._finish(output)
        tail = _sse(self.fmt.closing()) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _collect(self, send, output: RequestOutput, outputs) -> None:
        logprobs: dict[int, list[TokenLogprob]] = {}
        while True:
            for c in output.outputs:
                if c.new_logprobs:
                    logprobs.setdefault(c.index, []).extend(c.new_logprobs)
            self.fmt.count(output)
            if output.finished:
                break
            output = await self._next(outputs, output)
        self._finish(output)
        await self._send_json(send, 200, self.fmt.body(output, logprobs))


def _ended_as_abort(last: RequestOutput) -> RequestOutput:
    """A finished copy of `last` (no new tokens) whose unfinished choices end with "abort"."""
    choices = [
        CompletionOutput(
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            finish_reason=c.finish_reason or "abort",
            stop_reason=c.stop_reason,
        )
        for c in last.outputs
    ]
    return RequestOutput(
        last.request_id, last.prompt_token_ids, choices, finished=True, metrics=None
    )


def _sse(events: list[dict]) -> bytes:
    return b"".join(b"data: " + _dumps(e) + b"\n\n" for e in events)


# ------------------------------------------------------------------------------------------------
# Prompt building (runs in the thread pool: templating and tokenizing long prompts is CPU work)


def _needs_tokenizer(tokenizer, what: str, param: str) -> None:
    if tokenizer is None:
        raise ApiError(
            400,
            f"This model has no tokenizer, so {what} cannot be served: send token ids to "
            "/v1/completions.",
            param=param,
        )


def _render_chat(
    tokenizer, req: ChatCompletionRequest | TokenizeChatRequest, exclude_tools: bool = False
) -> Prompt:
    """`exclude_tools`: a request with tool_choice "none" renders without its tools."""
    _needs_tokenizer(tokenizer, "chat messages", "messages")
    tools = req.tools
    if exclude_tools and getattr(req, "tool_choice", None) == "none":
        tools = None
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs may not set {sorted(reserved)}.",
            param="chat_template_kwargs",
        )
    try:
        text = tokenizer.apply_chat_template(
            req.template_messages(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools,
            **kwargs,
        )
    except Exception as e:  # jinja2's raise_exception ("roles must alternate", ...): the input's
        raise ApiError(
            400, f"The chat template rejected these messages: {e}", param="messages"
        ) from e
    return Prompt(encode_text(tokenizer, text, param="messages"))  # the template wrote <bos>


def _completion_prompts(tokenizer, req: CompletionRequest) -> list[Prompt]:
    return [_completion_prompt(tokenizer, req, prompt) for prompt in req.prompts()]


def _completion_prompt(tokenizer, req: CompletionRequest, prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, str) or req.echo:
        _needs_tokenizer(tokenizer, "a text prompt or echo", "prompt")
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt, param="prompt")
        if req.add_special_tokens:
            ids = with_bos(ids, tokenizer.bos_token_id)
        return Prompt(ids, prompt if req.echo else "")
    if tokenizer is not None:  # else the engine checks against the model's vocabulary
        check_token_ids(prompt, tokenizer.vocab_size, param="prompt")
    echo = tokenizer.decode(prompt, skip_special_tokens=False) if req.echo else ""
    return Prompt(list(prompt), echo)


def _chat_prompts(tokenizer, req: ChatCompletionRequest, exclude_tools: bool) -> list[Prompt]:
    return [_render_chat(tokenizer, req, exclude_tools)]


# ------------------------------------------------------------------------------------------------
# Routes


async def _generation(
    request: Request,
    request_type: type[ChatCompletionRequest | CompletionRequest],
    build_prompt,
    response_format: type[ResponseFormat],
    id_prefix: str,
) -> GenerationResponse:
    """The pipeline both generation endpoints share: parse, prompt (off the event loop), context
    and sampling checks, then the response that runs the request."""
    state = _state(request)
    req = await read_request(request, request_type, state.limits)
    tokenizer = state.engine.tokenizer
    state.limits.check(req, tokenizer.vocab_size if tokenizer is not None else None)
    model = state.resolve_model(req.model)
    num_logprobs = req.num_logprobs
    if num_logprobs is not None and 0 <= state.max_logprobs < num_logprobs:
        param = "top_logprobs" if request_type is ChatCompletionRequest else "logprobs"
        raise ApiError(
            400,
            f"{param} must be at most {state.max_logprobs} (--max-logprobs), got {num_logprobs}",
            param=param,
        )
    wanted = req.wanted_prompt_logprobs
    if wanted is not None and 0 <= state.max_logprobs < wanted:
        raise ApiError(
            400,
            f"prompt_logprobs must be at most {state.max_logprobs} (--max-logprobs), got {wanted}",
            param="prompt_logprobs",
        )
    prompts: list[Prompt] = await run_in_threadpool(build_prompt, state.engine.tokenizer, req)
    params = []
    for prompt in prompts:
        _truncate(prompt, req.truncate_prompt_tokens, state.engine.max_model_len)
        max_tokens = check_context_length(
            len(prompt.token_ids),
            req.requested_max_tokens,
            state.engine.max_model_len,
            prompt_param=req.prompt_param,
        )
        params.append(
            req.sampling_params(
                max_tokens=max_tokens, logprobs=num_logprobs, defaults=state.sampling_defaults
            )
        )
    # vLLM: a client's X-Request-Id names the request (made unique if it is already running)
    given = _given_request_id(request.scope)
    request_id = f"{id_prefix}-{given.decode('latin-1') if given else uuid.uuid4().hex}"
    if request_id in state.inflight:
        request_id += f"-{uuid.uuid4().hex[:8]}"
    if state.log_requests:
        logger.info(
            "Received request %s: %s prompt tokens, params: %s",
            request_id,
            ", ".join(str(len(prompt.token_ids)) for prompt in prompts),
            params[0],
        )
    header = ResponseHeader(request_id, int(time.time()), model)
    fmt = response_format(header, req, state.token_strings, prompts, markers=state.chat_markers)
    if isinstance(req, ChatCompletionRequest) and state.chat_markers is not None:
        for prompt, one in zip(prompts, params):
            one.structured_outputs = state.chat_markers.after_thinking(
                one.structured_outputs, prompt.token_ids, req.chat_template_kwargs
            )
    if fmt.parses_output:  # the parser reads the special tokens the model writes
        for one in params:
            one.skip_special_tokens = False
    if req.stop_strings:  # one stop-string automaton for all prompts, not on the event loop
        automaton = await run_in_threadpool(StopStrings, req.stop_strings)
        for one in params:
            one.stop_strings = automaton
    return GenerationResponse(
        state, fmt, header.id, [prompt.token_ids for prompt in prompts], params, req.stream
    )


def _truncate(prompt: Prompt, truncate_prompt_tokens: int | None, max_model_len: int) -> None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last tokens (-1: the context length)."""
    if truncate_prompt_tokens is None:
        return
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens ({keep}) is larger than the context length ({max_model_len}).",
            param="truncate_prompt_tokens",
        )
    prompt.token_ids = prompt.token_ids[-keep:]


async def chat_completions(request: Request):
    exclude_tools = _state(request).exclude_tools_when_tool_choice_none
    prompts = functools.partial(_chat_prompts, exclude_tools=exclude_tools)
    return await _generation(
        request, ChatCompletionRequest, prompts, ChatFormat, id_prefix="chatcmpl"
    )


async def completions(request: Request):
    return await _generation(
        request, CompletionRequest, _completion_prompts, CompletionFormat, id_prefix="cmpl"
    )


async def tokenize(request: Request):
    """vLLM's /tokenize: a prompt or chat messages -> {count, max_model_len, tokens}."""
    state = _state(request)
    data = load_json_object(await read_body(request, state.limits))
    chat = "messages" in data
    req = validate_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
    state.resolve_model(req.model)
    tokenizer = state.engine.tokenizer
    _needs_tokenizer(tokenizer, "text", "messages" if chat else "prompt")

    def encode() -> list[int]:
        if chat:
            ids = _render_chat(tokenizer, req).token_ids
        else:
            ids = encode_text(tokenizer, req.prompt, param="prompt")
        return with_bos(ids, tokenizer.bos_token_id) if req.add_special_tokens else ids

    ids = await run_in_threadpool(encode)
    body = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    body["token_strs"] = [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return _json(200, body)


async def detokenize(request: Request):
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept)."""
    state = _state(request)
    req = await read_request(request, DetokenizeRequest, state.limits)
    state.resolve_model(req.model)
    tokenizer = state.engine.tokenizer
    _needs_tokenizer(tokenizer, "token ids", "tokens")
    check_token_ids(req.tokens, tokenizer.vocab_size, param="tokens")
    text = await run_in_threadpool(tokenizer.decode, req.tokens, skip_special_tokens=False)
    return _json(200, {"prompt": text})


def _openapi_url(request: Request) -> str:
    return request.scope.get("root_path", "") + "/openapi.json"


async def openapi(request: Request):
    from gemma4serve import __version__

    document = openapi_document(__version__)
    root_path = request.scope.get("root_path", "")
    if root_path:
        document = {**document, "servers": [{"url": root_path}]}
    return _json(200, document)


async def docs(request: Request):
    return HTMLResponse(docs_page(_openapi_url(request)))


async def list_models(request: Request):
    state = _state(request)
    return _json(
        200, {"object": "list", "data": [state.model_card(name) for name in state.model_names]}
    )


async def get_model(request: Request):
    state = _state(request)
    name = request.path_params["model"]
    return _json(200, state.model_card(state.resolve_model(name)))


async def health(request: Request):
    unavailable = _state(request).unavailable()
    if unavailable:
        return _json(503, error_body(unavailable, type="service_unavailable"))
    return _json(200, {"status": "ok"})


async def metrics(request: Request):
    body = await run_in_threadpool(
        _state(request).metrics.render
    )  # engine.stats() may take the engine's lock
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def version(request: Request):
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return _json(200, {"version": package_version("gemma4serve")})
    except PackageNotFoundError:  # running from a source checkout
        return _json(200, {"version": "unknown"})


# ------------------------------------------------------------------------------------------------
# Errors: every refusal in OpenAI's schema


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


async def _api_error(request: Request, exc: ApiError):
    return _json(exc.status, exc.body())


async def _request_error(request: Request, exc: RequestError):
    return _json(400, error_body(str(exc), param=exc.param, code=exc.code))


async def _http_error(request: Request, exc: HTTPException):
    message = f"{exc.detail}: {request.method} {request.url.path}"
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    return _json(exc.status_code, error_body(message, type=error_type), headers=exc.headers)


async def _internal_error(request: Request, exc: Exception):
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(
        500, error_body(f"internal error: {type(exc).__name__}", type="internal_server_error")
    )


# ------------------------------------------------------------------------------------------------


def build_app(
    engine: EngineClient,
    *,
    served_model_name: str | list[str],
    api_key: str | None = None,
    drain_timeout: float = 30.0,
    cors: CorsSettings | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    log_requests: bool = False,
    limits: RequestLimits | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
) -> Starlette:
    """The ASGI app over `engine` (an EngineProcessClient or anything with its interface).

    The app's startup calls `engine.start()`; its shutdown calls `engine.shutdown(drain_timeout)`
    off the event loop. `app.state.gemma4serve` is the ServerState: `begin_drain()` (the CLI
    calls it on SIGTERM) makes /health and new requests 503 and, `drain_timeout` seconds later,
    aborts what still runs; then it calls `on_drained` (server/drain.py). When the engine offers
    `default_sampling_params` (a dict, e.g. the checkpoint's generation_config), those fill what
    a request leaves unset, as vLLM does with a model's generation config. `limits` bound what
    one request may ask for (RequestLimits' defaults when None).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    state = ServerState(
        engine=engine,
        model_names=names,
        api_key=api_key or None,
        metrics=ServerMetrics(engine.stats, names[0]),
        token_strings=TokenStrings(engine.tokenizer),
        chat_markers=ChatMarkers.from_tokenizer(engine.tokenizer),
        sampling_defaults=dict(engine.default_sampling_params),
        drain_timeout=drain_timeout,
        max_logprobs=max_logprobs,
        log_requests=log_requests,
        limits=limits or RequestLimits(),
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
    )
    cors = cors or CorsSettings()

    @asynccontextmanager
    async def lifespan(app):
        engine.start()  # on the loop: the engine may bind its output queues to it
        state.ready = True
        drain_timer = asyncio.create_task(drain_when_asked(state))
        try:
            yield
        finally:
            state.begin_drain()
            drain_timer.cancel()
            await asyncio.to_thread(state.stop_engine)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        # Outermost first: CORS answers preflights before the gate asks for a key.
        middleware=[
            Middleware(
                CORSMiddleware,
                allow_origins=cors.allowed_origins,
                allow_methods=cors.allowed_methods,
                allow_headers=cors.allowed_headers,
                allow_credentials=cors.allow_credentials,
            ),
            Middleware(RequestIdHeader),
            Middleware(ApiGate, state=state),
        ],
        exception_handlers={
            ApiError: _api_error,
            RequestError: _request_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.gemma4serve = state
    return app
