"""Bounds that keep one client from hurting the others, each a CLI flag (`gemma4serve --help`).

Everything a request asks for costs the server in proportion to some size in it: the body to read
and parse, the stop strings to match after every token, the choices (each a sequence with its own
KV pages; a batched completion has n per prompt), the messages to template. Each size is bounded
here and a request past a bound gets a 400 naming the field and the flag (a body past its bound
gets a 413, before it is parsed).
Logprobs are bounded by vLLM's `--max-logprobs`, checked in the app.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from gemma4serve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)

# Bodies above this are parsed in a worker thread rather than on the event loop.
PARSE_IN_THREAD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    # A 256K-token prompt as JSON text or token ids is a few MB; 32 MiB leaves room for escapes.
    max_request_body_bytes: int = 32 * 1024 * 1024
    # OpenAI allows 4 stop strings; these are generous, and keep matching and hold-back small.
    max_stop_sequences: int = 64  # entries of `stop`, of `stop_token_ids`, of `bad_words`
    max_stop_chars: int = 4096  # characters over all of `stop`, over all of `bad_words`
    max_n: int = 128  # OpenAI's bound on `n`
    # Each choice is an engine sequence: `n` times the prompts of a batched completion.
    max_choices: int = 1024
    max_messages: int = 4096  # entries of a chat's `messages`

    def check(
        self, request: ChatCompletionRequest | CompletionRequest, vocab_size: int | None
    ) -> None:
        """Raise ApiError(400) naming the first bound the request exceeds. Token-id lists
        (`logit_bias`, `allowed_token_ids`) hold at most `vocab_size` entries, when it is known."""
        for param, words in (("stop", request.stop_strings), ("bad_words", request.bad_words)):
            words = words or ()
            _bound(param, len(words), self.max_stop_sequences, param, "--max-stop-sequences")
            chars = sum(len(word) for word in words)
            _bound(param, chars, self.max_stop_chars, f"characters of {param}", "--max-stop-chars")
        stop_ids = request.stop_token_ids or ()
        _bound(
            "stop_token_ids",
            len(stop_ids),
            self.max_stop_sequences,
            "stop_token_ids",
            "--max-stop-sequences",
        )
        _bound("n", request.n, self.max_n, "choices (n)", "--max-n")
        prompts = len(request.prompts()) if isinstance(request, CompletionRequest) else 1
        _bound(
            "prompt" if prompts > 1 else "n",
            prompts * request.n,
            self.max_choices,
            "choices (prompts times n)",
            "--max-choices",
        )
        if isinstance(request, ChatCompletionRequest):
            _bound(
                "messages", len(request.messages), self.max_messages, "messages", "--max-messages"
            )
        if vocab_size is not None:
            for param in ("logit_bias", "allowed_token_ids"):
                entries = len(getattr(request, param) or ())
                _bound(param, entries, vocab_size, f"{param} entries", "the vocabulary's size")


def _bound(param: str, value: int, limit: int, what: str, flag: str) -> None:
    if value > limit:
        raise ApiError(
            400,
            f"This server takes at most {limit} {what} per request ({flag}); "
            f"this request has {value}.",
            param=param,
            code="invalid_value",
        )


async def read_request(request: Request, request_type: type, limits: RequestLimits):
    """The request's body as a validated `request_type`; large bodies are parsed off the loop."""
    body = await read_body(request, limits)
    if len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_request, request_type, body)
    return parse_request(request_type, body)


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The raw body: 415 when it is not declared JSON, 413 past max_request_body_bytes (read no
    further than that)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:  # none given: taken as JSON, as curl users expect
        media_type = content_type.partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise ApiError(
                415,
                f"Unsupported content type '{media_type}': send the body as application/json.",
                code="unsupported_media_type",
            )
    max_bytes = limits.max_request_body_bytes
    too_large = ApiError(
        413,
        f"The request body is larger than {max_bytes} bytes (--max-request-body-bytes).",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > max_bytes:
                raise too_large
    except ClientDisconnect:
        raise ApiError(400, "The client disconnected while sending the request.") from None
    return bytes(body)
