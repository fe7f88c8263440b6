"""The engine loop behind the socket: requests in, one `EngineOutputs` message per step out.

`run_engine_core` is the engine process's entry point (or, with --no-engine-process, a thread's):
it loads the engine, says `Ready` (or `StartupFailed`), then alternates between the requests that
arrived and one engine step, and sends each step's new tokens of every request in one message.
The engine never detokenizes here: the server does, and sends back the choices stop strings end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import zmq

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.engine.outputs import RequestOutput
from gemma4serve.engine_process.messages import (
    AbortRequests,
    AddRequest,
    Codec,
    EngineOutputs,
    Ready,
    RequestFailure,
    Shutdown,
    StartupFailed,
    StopChoices,
)
from gemma4serve.parallel.workers import stopped_by_parent
from gemma4serve.validation import RequestError

log = logging.getLogger("gemma4serve")

IDLE_POLL_MS = 200  # an idle engine wakes this often to notice that its server is gone
# A pass reads requests for at most this long before it steps and answers: a burst of requests
# whose grammars compile neither stalls the running streams nor looks hung to the server.
READ_BUDGET_S = 0.5


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    log_level: str | None,
    server_pid: int | None = None,
) -> None:
    """Serve the engine over the two sockets until `Shutdown` (or the server process dies).

    `log_level` and `server_pid` (the process that spawned this one) are set in a spawned process
    (its logging starts blank) and None in a thread."""
    if log_level is not None:
        from gemma4serve.cli import setup_logging

        setup_logging(log_level)
    if server_pid is not None:
        # The server's own pid, not this process's parent when it gets here: a server that died
        # while this process started (imports take seconds) would leave init to be watched.
        stopped_by_parent(server_pid)  # also while it loads, which takes minutes
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    codec = Codec()
    try:
        try:
            # The server's OutputProcessor makes the text: steps here never wait on it.
            engine = LLMEngine(dataclasses.replace(args, detokenize=False), log_level)
        except Exception as e:  # bad path, no GPU, out of memory...: the server reports it
            log.debug("engine start-up failed", exc_info=True)
            outbox.send(codec.encode(StartupFailed(f"{type(e).__name__}: {e}")))
            return
        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else engine.state.target_dir
        ready = Ready(
            pid=os.getpid(),
            max_model_len=engine.max_model_len,
            tokenizer_dir=str(tokenizer_dir) if engine.tokenizer is not None else None,
            default_sampling_params=engine.default_sampling_params,
            stats=engine.snapshot(),
        )
        outbox.send(codec.encode(ready))
        try:
            parent_pid = os.getppid() if server_pid is None else server_pid
            EngineCore(engine, inbox, outbox, codec, parent_pid).run()
        finally:
            engine.shutdown()
    finally:
        context.destroy(linger=1000)


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        codec: Codec,
        parent_pid: int,
    ):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.codec = codec
        self.parent_pid = parent_pid  # the loop runs while this process is the parent
        self.messages_taken = 0

    def run(self) -> None:
        engine = self.engine
        while os.getppid() == self.parent_pid:  # the server process is gone: so are we
            if not engine.has_unfinished() and not self.inbox.poll(IDLE_POLL_MS):
                continue
            outputs: list[RequestOutput] = []
            failures: list[RequestFailure] = []
            running = self._take_requests(outputs, failures)
            failed = None
            if running and engine.has_unfinished():
                try:
                    outputs += engine.step()
                except Exception as e:  # a bug must not hang every client: fail what runs
                    log.exception("engine step failed; aborting in-flight requests")
                    failed = e
                    for request_id in list(engine.requests):
                        engine.abort(request_id)
                        failures.append(RequestFailure(request_id, f"engine error: {e}", False))
            message = EngineOutputs(
                outputs, failures, engine.snapshot(), self.messages_taken, engine.has_unfinished()
            )
            self.outbox.send(self.codec.encode(message), copy=False)
            if failed is not None and engine.workers is not None:
                # The tensor-parallel ranks may have stopped at different collectives of that
                # step: no later step can run, so the engine ends (the server exits 1).
                raise RuntimeError("a tensor-parallel step failed") from failed
            if not running:
                return

    def _take_requests(self, outputs: list[RequestOutput], failures: list[RequestFailure]) -> bool:
        """Apply the requests that arrived (for up to READ_BUDGET_S); False on `Shutdown` (after
        aborting what runs)."""
        deadline = time.monotonic() + READ_BUDGET_S
        while time.monotonic() < deadline:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            self.messages_taken += 1
            message = self.codec.requests.decode(frame.buffer)
            if isinstance(message, AddRequest):
                try:
                    self.engine.add_request(
                        message.request_id,
                        message.prompt_token_ids,
                        message.params,
                        message.arrival_time,
                    )
                except RequestError as e:
                    failure = RequestFailure(message.request_id, str(e), True, e.param, e.code)
                    failures.append(failure)
                except ValueError as e:  # sampling settings the engine refused
                    failures.append(RequestFailure(message.request_id, str(e), True))
            elif isinstance(message, StopChoices):
                for stop in message.stops:
                    self.engine.stop_choice(stop)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    output = self.engine.abort(request_id)
                    if output is not None:
                        outputs.append(output)
            elif isinstance(message, Shutdown):
                outputs += [
                    self.engine.abort(request_id) for request_id in list(self.engine.requests)
                ]
                return False
        return True
