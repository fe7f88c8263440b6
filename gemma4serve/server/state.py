"""What the routes share: the engine, the settings and the server's lifecycle switches."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gemma4serve.chat.output import ChatMarkers
from gemma4serve.engine.client import EngineClient
from gemma4serve.server.metrics import ServerMetrics
from gemma4serve.server.protocol import ApiError, TokenStrings
from gemma4serve.server.settings import ServerSettings


@dataclass
class ServerState:
    """What the routes share: the engine, the settings, the server's lifecycle switches."""

    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    token_strings: TokenStrings
    chat_markers: ChatMarkers | None  # the tokenizer's channel and tool-call tokens, if any
    sampling_defaults: dict
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False  # the engine thread runs
    draining: bool = False  # shutting down: refuse new work, let running requests finish
    drain_cut: bool = False  # stop waiting for running requests: the drain aborts them
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

    def cut_drain(self) -> None:
        """Stop waiting for running requests: the drain aborts them at its next poll; safe in a
        signal handler."""
        self.drain_cut = True

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
            drain_timeout=self.settings.drain_timeout if drain_timeout is None else drain_timeout
        )

    @property
    def model_names(self) -> list[str]:
        return self.settings.served_model_names

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
