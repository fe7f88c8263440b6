"""The engine as the server sees it: one protocol, implemented by `AsyncEngine` and the tests' fake.

The messages that cross into the engine's loop are typed here too; a later engine process speaks
the same messages over its socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from gemma4serve.engine.outputs import EngineStats, RequestOutput
from gemma4serve.sampling_params import SamplingParams


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine."""

    tokenizer: object  # encode / decode / apply_chat_template / bos_token_id / vocab_size
    max_model_len: int
    model_name: str
    default_sampling_params: dict  # the checkpoint's generation_config defaults

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


@dataclass
class AddRequest:
    """A new request and where its outputs go (an asyncio queue read on `loop`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass
class AbortRequest:
    request_id: str


EngineMessage = AddRequest | AbortRequest
