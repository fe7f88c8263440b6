"""The HTTP layer: an OpenAI-compatible Starlette app over one engine.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming or one JSON body),
GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /health (and vLLM's
alias GET|POST /ping), GET /metrics, GET /version, GET /openapi.json, GET /docs. Every refusal is
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
import logging
import time
import uuid
from contextlib import asynccontextmanager

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
from gemma4serve.server.drain import drain_when_asked
from gemma4serve.server.formats import ChatFormat, CompletionFormat, Prompt, ResponseFormat
from gemma4serve.server.limits import read_body, read_request
from gemma4serve.server.metrics import ServerMetrics
from gemma4serve.server.middleware import ApiGate, RequestIdHeader, given_request_id
from gemma4serve.server.openapi import docs_page, openapi_document
from gemma4serve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseHeader,
    StreamOptions,
    TokenIdStrings,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenStrings,
    error_body,
    load_json_object,
    validate_request,
)
from gemma4serve.server.responses import GenerationResponse, json_response
from gemma4serve.server.settings import RESERVED_TEMPLATE_KWARGS, ServerSettings
from gemma4serve.server.state import ServerState
from gemma4serve.server.stats_log import log_stats
from gemma4serve.stop_strings import StopStrings
from gemma4serve.validation import (
    RequestError,
    check_context_length,
    check_token_ids,
    encode_text,
    with_bos,
)

logger = logging.getLogger("gemma4serve.server")


def _state(request: Request) -> ServerState:
    return request.app.state.gemma4serve


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


def _fill_template_kwargs(req: ChatCompletionRequest | TokenizeChatRequest, state) -> None:
    """The template's variables, as vLLM layers them: the request's chat_template_kwargs, then
    what its reasoning_effort implies (thinking on unless "none"), then the server's
    --default-chat-template-kwargs."""
    given = dict(req.chat_template_kwargs or {})
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        given["reasoning_effort"] = effort
        given.setdefault("enable_thinking", effort != "none")
    merged = state.settings.default_chat_template_kwargs | given
    req.chat_template_kwargs = merged or None


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
    settings = state.settings
    req = await read_request(request, request_type, settings.limits)
    if settings.force_include_usage and req.stream:  # vLLM: usage in every chunk too
        req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
    if isinstance(req, ChatCompletionRequest):
        _fill_template_kwargs(req, state)
    tokenizer = state.engine.tokenizer
    settings.limits.check(req, tokenizer.vocab_size if tokenizer is not None else None)
    model = state.resolve_model(req.model)
    num_logprobs = req.num_logprobs
    if num_logprobs is not None and 0 <= settings.max_logprobs < num_logprobs:
        param = "top_logprobs" if request_type is ChatCompletionRequest else "logprobs"
        raise ApiError(
            400,
            f"{param} must be at most {settings.max_logprobs} (--max-logprobs), got {num_logprobs}",
            param=param,
        )
    wanted = req.wanted_prompt_logprobs
    if wanted is not None and 0 <= settings.max_logprobs < wanted:
        raise ApiError(
            400,
            f"prompt_logprobs must be at most {settings.max_logprobs} (--max-logprobs), "
            f"got {wanted}",
            param="prompt_logprobs",
        )
    prompts: list[Prompt] = await run_in_threadpool(build_prompt, state.engine.tokenizer, req)
    params = []
    for prompt in prompts:
        _truncate(prompt, req, state.engine.max_model_len)
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
    given = given_request_id(request.scope)
    request_id = f"{id_prefix}-{given.decode('latin-1') if given else uuid.uuid4().hex}"
    if request_id in state.inflight:
        request_id += f"-{uuid.uuid4().hex[:8]}"
    if settings.log_requests:
        logger.info(
            "Received request %s: %s prompt tokens, params: %s",
            request_id,
            ", ".join(str(len(prompt.token_ids)) for prompt in prompts),
            params[0],
        )
    header = ResponseHeader(request_id, int(time.time()), model)
    strings = state.token_strings
    as_ids = req.return_tokens_as_token_ids
    if as_ids or (as_ids is None and settings.return_tokens_as_token_ids):
        strings = TokenIdStrings(strings)
    fmt = response_format(header, req, strings, prompts, markers=state.chat_markers)
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


def _truncate(
    prompt: Prompt, req: ChatCompletionRequest | CompletionRequest, max_model_len: int
) -> None:
    """vLLM's truncate_prompt_tokens: keep that many of the prompt's tokens (-1: the context
    length), the last ones unless truncation_side is "right"."""
    if req.truncate_prompt_tokens is None:
        return
    keep = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if keep > max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens ({keep}) is larger than the context length ({max_model_len}).",
            param="truncate_prompt_tokens",
        )
    ids = prompt.token_ids
    prompt.token_ids = ids[:keep] if req.truncation_side == "right" else ids[-keep:]


async def chat_completions(request: Request):
    exclude_tools = _state(request).settings.exclude_tools_when_tool_choice_none
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
    data = load_json_object(await read_body(request, state.settings.limits))
    chat = "messages" in data
    req = validate_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
    if chat:
        _fill_template_kwargs(req, state)
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
    return json_response(200, body)


async def detokenize(request: Request):
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept)."""
    state = _state(request)
    req = await read_request(request, DetokenizeRequest, state.settings.limits)
    state.resolve_model(req.model)
    tokenizer = state.engine.tokenizer
    _needs_tokenizer(tokenizer, "token ids", "tokens")
    check_token_ids(req.tokens, tokenizer.vocab_size, param="tokens")
    text = await run_in_threadpool(tokenizer.decode, req.tokens, skip_special_tokens=False)
    return json_response(200, {"prompt": text})


def _openapi_url(request: Request) -> str:
    return request.scope.get("root_path", "") + "/openapi.json"


async def openapi(request: Request):
    from gemma4serve import __version__

    document = openapi_document(__version__)
    root_path = request.scope.get("root_path", "")
    if root_path:
        document = {**document, "servers": [{"url": root_path}]}
    return json_response(200, document)


async def docs(request: Request):
    return HTMLResponse(docs_page(_openapi_url(request)))


async def list_models(request: Request):
    state = _state(request)
    return json_response(
        200, {"object": "list", "data": [state.model_card(name) for name in state.model_names]}
    )


async def get_model(request: Request):
    state = _state(request)
    name = request.path_params["model"]
    return json_response(200, state.model_card(state.resolve_model(name)))


async def health(request: Request):
    unavailable = _state(request).unavailable()
    if unavailable:
        return json_response(503, error_body(unavailable, type="service_unavailable"))
    return json_response(200, {"status": "ok"})


async def metrics(request: Request):
    body = await run_in_threadpool(
        _state(request).metrics.render
    )  # engine.stats() may take the engine's lock
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def version(request: Request):
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return json_response(200, {"version": package_version("gemma4serve")})
    except PackageNotFoundError:  # running from a source checkout
        return json_response(200, {"version": "unknown"})


# ------------------------------------------------------------------------------------------------
# Errors: every refusal in OpenAI's schema


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


async def _api_error(request: Request, exc: ApiError):
    return json_response(exc.status, exc.body())


async def _request_error(request: Request, exc: RequestError):
    return json_response(400, error_body(str(exc), param=exc.param, code=exc.code))


async def _http_error(request: Request, exc: HTTPException):
    message = f"{exc.detail}: {request.method} {request.url.path}"
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    return json_response(exc.status_code, error_body(message, type=error_type), headers=exc.headers)


async def _internal_error(request: Request, exc: Exception):
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(
        500, error_body(f"internal error: {type(exc).__name__}", type="internal_server_error")
    )


# ------------------------------------------------------------------------------------------------


def build_app(engine: EngineClient, settings: ServerSettings) -> Starlette:
    """The ASGI app over `engine` (an EngineProcessClient or anything with its interface).

    The app's startup calls `engine.start()`; its shutdown calls `engine.shutdown(drain_timeout)`
    off the event loop. `app.state.gemma4serve` is the ServerState: `begin_drain()` (the CLI
    calls it on SIGTERM) makes /health and new requests 503 and, `drain_timeout` seconds later,
    aborts what still runs; then it calls `on_drained` (server/drain.py). When the engine offers
    `default_sampling_params` (a dict, e.g. the checkpoint's generation_config), those fill what
    a request leaves unset, as vLLM does with a model's generation config.
    """
    state = ServerState(
        engine=engine,
        settings=settings,
        metrics=ServerMetrics(
            engine.stats, settings.served_model_names[0], settings.metrics_prefix
        ),
        token_strings=TokenStrings(engine.tokenizer),
        chat_markers=ChatMarkers.from_tokenizer(engine.tokenizer),
        sampling_defaults=dict(engine.default_sampling_params),
    )
    cors = settings.cors

    @asynccontextmanager
    async def lifespan(app):
        engine.start()  # on the loop: the engine may bind its output queues to it
        state.ready = True
        timers = [asyncio.create_task(drain_when_asked(state))]
        if settings.log_stats_interval:
            timers.append(asyncio.create_task(log_stats(state, settings.log_stats_interval)))
        try:
            yield
        finally:
            state.begin_drain()
            for timer in timers:
                timer.cancel()
            await asyncio.to_thread(state.stop_engine)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # vLLM's alias (SageMaker's probe)
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    if settings.openapi_docs:
        routes += [
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/docs", docs, methods=["GET"]),
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
