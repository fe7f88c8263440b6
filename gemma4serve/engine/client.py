"""The engine as the server sees it: one protocol, implemented by
`engine_process.client.EngineProcessClient` (the engine in its own process, or a thread) and the
tests' fake."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from gemma4serve.engine.outputs import EngineStats, RequestOutput
from gemma4serve.sampling_params import SamplingParams


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine."""

    tokenizer: object  # encode / decode / apply_chat_template / bos_token_id / vocab_size
    max_model_len: int
    model_name: str
    default_sampling_params: dict  # the checkpoint's generation_config defaults
    dead: bool  # the engine ended on its own (the server then exits non-zero)
    on_dead: Callable[[], None] | None  # set by the server; called on its loop when the engine dies

    @property
    def ready(self) -> bool:
        """The engine runs and takes requests (False once it died or drains)."""

    def start(self) -> None:
        """Start the engine's loop; called on the server's event loop."""

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, the last one finished. Raises ValueError (a RequestError) on a
        request the engine refuses; closing the iterator early aborts the request."""

    def abort(self, request_id: str) -> None:
        """End a request wherever it is; its stream gets a final output with "abort"."""

    def stats(self) -> EngineStats:
        """The latest statistics snapshot (cheap: no wait on the engine)."""

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to drain_timeout s, abort the rest."""
