"""The engine in its own thread, for the server: add a request and iterate its outputs; abort by id.

The step loop never waits on HTTP handling and a slow client never stalls other requests: the
thread pushes each output into the request's asyncio queue with `call_soon_threadsafe` and moves
on. It implements `EngineClient`; requests reach its thread as `AddRequest` / `AbortRequest`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.client import AbortRequest, AddRequest, EngineMessage
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.engine.outputs import EngineStats, RequestOutput
from gemma4serve.sampling_params import SamplingParams

log = logging.getLogger("gemma4serve")


class EngineShuttingDown(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, args: EngineArgs):
        self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = args.served_model_name or args.model
        self.default_sampling_params = self.engine.default_sampling_params
        self._inbox: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._streams: dict[str, AddRequest] = {}  # running requests: where their outputs go
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._stats = self.engine.snapshot()
        self._thread: threading.Thread | None = None

    # ---- public API (event-loop side) -------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gemma4serve-engine", daemon=True
            )
            self._thread.start()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._accepting

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise EngineShuttingDown("the server is shutting down")
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._inbox.put(AddRequest(request_id, list(prompt_token_ids), params, loop, q))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if (
                not finished
            ):  # the consumer went away (client disconnect) or an error: free its pages
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def kv_pool_free(self) -> int:
        return self._stats.kv_pages_free

    def num_unfinished(self) -> int:
        stats = self._stats
        return stats.num_running + stats.num_waiting

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to drain_timeout s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while (
            self._streams
            and time.monotonic() < deadline
            and self._thread
            and self._thread.is_alive()
        ):
            time.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- engine thread --------------------------------------------------------------------------

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._streams.pop(request_id, None)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                self._add(message)
            else:
                self._abort(message.request_id)

    def _add(self, message: AddRequest) -> None:
        rid = message.request_id
        self._streams[rid] = message
        try:
            self.engine.add_request(rid, message.prompt_token_ids, message.params)
        except ValueError as e:
            self._push(rid, e)
            self._streams.pop(rid, None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._push(request_id, output)
        self._streams.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._stats = self.engine.snapshot()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except (
                Exception
            ) as e:  # a bug must not hang every client: fail what is in flight and go on
                log.exception("engine step failed; aborting in-flight requests")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    self._push(rid, RuntimeError(f"engine error: {e}"))
                    self._streams.pop(rid, None)
                outs = []
            for out in outs:
                self._push(out.request_id, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            self._stats = self.engine.snapshot()
