"""One generation as an ASGI response: the request run on the engine and written out, streamed
(SSE) or as one JSON body, with the client's disconnect watched for its whole life."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import TYPE_CHECKING

from starlette.responses import Response

from gemma4serve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.server.batch import merged_outputs
from gemma4serve.server.formats import ResponseFormat
from gemma4serve.server.protocol import error_body
from gemma4serve.validation import RequestError

if TYPE_CHECKING:
    from gemma4serve.server.state import ServerState

logger = logging.getLogger("gemma4serve.server")


def dumps(obj) -> bytes:
    """Compact UTF-8 JSON; with a lone surrogate from the request (echoed in a message) in it,
    ASCII JSON (the surrogate escaped)."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def json_response(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json", headers=headers)


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
        await send({"type": "http.response.body", "body": dumps(body)})

    async def _run(self, send) -> None:
        engine = self.state.engine
        outputs = None
        # The engine refuses an id in use; a client's X-Request-Id may repeat one in flight, or
        # one prompt's id of a batch. Checked and taken with no await between.
        if not self.state.inflight.isdisjoint(self.engine_ids):
            suffix = uuid.uuid4().hex[:8]
            self.engine_ids = [f"{engine_id}-{suffix}" for engine_id in self.engine_ids]
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
                first = self.fmt.shown(await outputs.__anext__())
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
                        "body": b"data: " + dumps(body) + b"\n\ndata: [DONE]\n\n",
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
        return self.fmt.shown(output)

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
    return b"".join(b"data: " + dumps(e) + b"\n\n" for e in events)
