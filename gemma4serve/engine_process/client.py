"""The server's side of the engine process: an `EngineClient` over two zmq sockets.

The engine runs in a process of its own (spawned: CUDA must not be forked), so that its stepping
never shares the GIL with HTTP, JSON, SSE and detokenization. Requests go out on one socket; every
engine step comes back as one message of new token ids, which a task on the event loop turns into
text (`OutputProcessor`: the choices stop strings end go back as one `StopChoices` message) and
splits into the requests' asyncio queues (a slow client's queue grows, nobody waits on it). A
watchdog notices a dead engine within `WATCH_INTERVAL_S`, and a hung one (a message due for more
than `iteration_timeout` seconds: it is killed); a failed output reader ends the server too: every
running request fails, `ready` turns False (/health 503) and `on_dead` is called (the CLI then
stops the server with a non-zero exit).

`in_process=True` (--no-engine-process) runs the same loop in a thread of this process, over the
same sockets: one code path either way.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.output_processor import OutputProcessor
from gemma4serve.engine.outputs import EngineStats, RequestOutput
from gemma4serve.engine_process import ITERATION_TIMEOUT_S
from gemma4serve.engine_process.messages import (
    AbortRequests,
    AddRequest,
    Codec,
    EngineOutputs,
    Ready,
    Shutdown,
    StartupFailed,
    StopChoices,
)
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.tokenizer import Tokenizer
from gemma4serve.validation import RequestError

log = logging.getLogger("gemma4serve")

WATCH_INTERVAL_S = 0.1  # how often the watchdog checks that the engine lives
# The most one watchdog tick counts towards a hang: a server paused or starved (Ctrl-Z, docker
# pause, a busy event loop) does not charge its own pause to the engine.
LONGEST_TICK_S = 1.0
STOP_TIMEOUT_S = 10.0  # after Shutdown, how long the engine gets to exit before it is killed
LAST_MESSAGE_WAIT_MS = 1000  # how long a message an exited engine sent may take to be readable


class EngineStartupError(RuntimeError):
    """The engine could not start (bad model path, no GPU, out of memory...)."""


class EngineDeadError(RuntimeError):
    """The engine process ended while the server still needed it."""


class EngineShuttingDown(RuntimeError):
    pass


def run_engine(*args) -> None:
    """The engine's entry in its process (or thread): the engine's imports (torch, xgrammar, CUDA's
    libraries) happen there, never in the server process, which starts sooner and stays small."""
    from gemma4serve.engine_process.core import run_engine_core

    run_engine_core(*args)


class _EngineThread:
    """--no-engine-process: the engine loop on a thread, with the Process methods the client
    uses."""

    def __init__(self, target, args):
        self.thread = threading.Thread(
            target=target, args=args, name="gemma4serve-engine", daemon=True
        )
        self.exitcode = None

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def kill(self) -> None:  # a thread cannot be killed; it is a daemon
        pass


class EngineProcessClient:
    """`EngineClient` for an engine in its own process (or thread, `in_process=True`)."""

    def __init__(
        self,
        args: EngineArgs,
        *,
        in_process: bool = False,
        log_level: str = "info",
        iteration_timeout: float = ITERATION_TIMEOUT_S,
    ):
        """`iteration_timeout`: seconds a due engine message may take before the engine counts as
        hung (0: never)."""
        self.model_name = args.served_model_name or args.model
        self.on_dead: Callable[[], None] | None = None  # called on the event loop
        self.dead = False
        self.iteration_timeout = iteration_timeout
        # Whether the engine owes a message (see EngineOutputs): one after reading what was sent,
        # and one after every pass while it has requests.
        self._messages_sent = 0
        self._messages_heard = 0
        self._engine_messages_taken = 0
        self._engine_unfinished = False
        self._codec = Codec()
        self._queues: dict[str, asyncio.Queue] = {}  # by request; touched on the event loop only
        self._stats = EngineStats()
        self._accepting = True
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._socket_dir = tempfile.mkdtemp(prefix="gemma4serve-")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the server on a busy engine
        self._input.setsockopt(zmq.LINGER, 0)
        input_address, output_address = (f"ipc://{self._socket_dir}/{n}" for n in ("in", "out"))
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()  # sends come from the loop and the shutdown thread
        if in_process:
            core_args = (args, input_address, output_address, None)
            self._engine = _EngineThread(run_engine, core_args)
        else:
            spawn = multiprocessing.get_context("spawn")
            self._engine = spawn.Process(
                target=run_engine,
                args=(args, input_address, output_address, log_level, os.getpid()),
                name="gemma4serve-engine",
                # A daemonic process may not start processes: the tensor-parallel workers.
                daemon=args.tensor_parallel_size == 1,
            )
        self._engine.start()
        try:
            ready = self._wait_for_ready()
        except BaseException:
            self._stop_engine(send_shutdown=False)
            raise
        self.engine_pid = ready.pid
        self.max_model_len = ready.max_model_len
        self.default_sampling_params = ready.default_sampling_params
        self._stats = ready.stats
        self.tokenizer = Tokenizer.from_dir(ready.tokenizer_dir) if ready.tokenizer_dir else None
        self._outputs = OutputProcessor(self.tokenizer)  # touched on the event loop only
        if not in_process:
            log.info("engine process started (pid %d)", ready.pid)

    def _wait_for_ready(self) -> Ready:
        while not self._output.poll(int(WATCH_INTERVAL_S * 1000)):
            # An engine may send StartupFailed and exit after a poll: read its last words first.
            if not self._engine.is_alive() and not self._output.poll(LAST_MESSAGE_WAIT_MS):
                raise EngineStartupError(
                    f"the engine process exited with code {self._engine.exitcode} while starting"
                )
        message = self._codec.messages.decode(self._output.recv())
        if isinstance(message, StartupFailed):
            raise EngineStartupError(message.message)
        assert isinstance(message, Ready), message
        return message

    # ---- EngineClient -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._loop is not None and self._accepting and not self.dead

    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        outputs = zmq.asyncio.Socket.from_socket(self._output)
        self._tasks = [
            asyncio.ensure_future(self._read_outputs(outputs)),
            asyncio.ensure_future(self._watch()),
        ]
        self._tasks[0].add_done_callback(self._reader_ended)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        if not self._accepting:
            raise EngineShuttingDown("the server is shutting down")
        # The engine refuses a repeated id too, but only after this request's queue had replaced
        # the first one's, which would then never be filled.
        if request_id in self._queues:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt_token_ids = list(prompt_token_ids)
        self._outputs.add_request(request_id, prompt_token_ids, params)
        try:
            self._send(AddRequest(request_id, prompt_token_ids, params, time.monotonic()))
        except (OverflowError, UnicodeEncodeError):  # the wire's integers are 64-bit, its text
            self._outputs.remove(request_id)  # UTF-8 (a prompt id, a logprobs count, a surrogate)
            raise RequestError(
                "the request holds an integer past 64 bits or text that is not valid Unicode"
            ) from None
        # No await since the send: the request's first output cannot have been dispatched yet.
        queue = self._queues[request_id] = asyncio.Queue()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._outputs.remove(request_id)
            if not finished:  # the consumer went away (client disconnect) or an error
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(AbortRequests([request_id]))

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to drain_timeout s, abort the rest,
        stop the engine process. Blocks: call it off the event loop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._queues and not self.dead and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._queues and not self.dead:
            self._send(AbortRequests(list(self._queues)))
        self._stop_engine(send_shutdown=not self.dead)

    # ---- internals ----------------------------------------------------------------------------

    def _send(self, message) -> None:
        if self.dead:
            return
        frame = self._codec.encode(message)
        with self._send_lock:
            self._messages_sent += 1  # before the send: the engine never reports more taken
            self._input.send(frame, copy=False)

    def _stop_engine(self, send_shutdown: bool) -> None:
        """`send_shutdown`: ask the engine to stop and give it STOP_TIMEOUT_S; else (not ready
        yet, or dead) nothing can ask it: kill what is left at once."""
        self._stopping = True
        if send_shutdown:
            self._send(Shutdown())
            self._engine.join(STOP_TIMEOUT_S)
            if self._engine.is_alive():
                log.warning("the engine did not stop within %.0fs: killing it", STOP_TIMEOUT_S)
        self._engine.kill()
        self._engine.join(STOP_TIMEOUT_S)
        if self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._close_sockets(), self._loop)
        else:
            self._context.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    async def _close_sockets(self) -> None:
        """Stop the readers, then end the context now: one left to the garbage collector can be
        finalized before its sockets and block forever in term()."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._context.destroy(linger=0)

    async def _read_outputs(self, socket: zmq.asyncio.Socket) -> None:
        decode = self._codec.messages.decode
        while True:
            message = decode(await socket.recv(copy=False))
            if isinstance(message, EngineOutputs):
                self._dispatch(message)

    def _dispatch(self, message: EngineOutputs) -> None:
        self._messages_heard += 1
        self._engine_messages_taken = message.messages_taken
        self._engine_unfinished = message.unfinished
        self._stats = message.stats
        stops = []
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            output, stopped = self._outputs.process(output)
            if queue is not None and output is not None:
                queue.put_nowait(output)
                stops += stopped
        if stops:
            self._send(StopChoices(stops))
        for failure in message.failures:
            queue = self._queues.get(failure.request_id)
            if queue is None:
                continue
            if failure.invalid:
                error = RequestError(failure.message, param=failure.param, code=failure.code)
            else:
                error = RuntimeError(failure.message)
            queue.put_nowait(error)

    def _owes_message(self) -> bool:
        return self._engine_unfinished or self._messages_sent > self._engine_messages_taken

    async def _watch(self) -> None:
        """Until the engine ends: `waited` adds up the ticks in which a message was owed and none
        came."""
        waited, heard = 0.0, self._messages_heard
        while self._engine.is_alive():
            tick = time.monotonic()
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self._stopping or self.dead:
                return
            if heard != self._messages_heard or not self._owes_message():
                waited, heard = 0.0, self._messages_heard
            else:
                waited += min(time.monotonic() - tick, LONGEST_TICK_S)
            if 0 < self.iteration_timeout < waited:
                log.error(
                    "the engine has not answered for %.0fs (--engine-iteration-timeout): it is "
                    "hung; stopping it and failing %d running request(s)",
                    waited,
                    len(self._queues),
                )
                self._engine.kill()
                self._fail_everything("the engine stopped responding")
                return
        if not self._stopping and not self.dead:
            log.error(
                "the engine process died (exit code %s): failing %d running request(s)",
                self._engine.exitcode,
                len(self._queues),
            )
            self._fail_everything("the engine process died")

    def _reader_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._stopping or self.dead:
            return
        log.error("reading the engine's outputs failed", exc_info=task.exception())
        self._engine.kill()
        self._fail_everything("the server failed to read the engine's outputs")

    def _fail_everything(self, reason: str) -> None:
        """The engine is gone or unusable: fail every running request, refuse new ones, and let
        the server stop."""
        self.dead = True
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead()
