"""The messages between the server process and the engine process, and their msgpack codec.

Requests carry `SamplingParams` whole, so a field added there crosses without changes here (the
codec encodes dataclasses field by field; a field must stay msgpack-encodable). Outputs carry only
what is new since the request's last output: one `EngineOutputs` per engine step holds every
request's new tokens, and the server rebuilds the cumulative text and token ids.
"""

from __future__ import annotations

import msgspec

from gemma4serve.engine.outputs import EngineStats, RequestMetrics, TokenLogprob
from gemma4serve.sampling_params import SamplingParams

# ---- server -> engine ---------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what runs and end the engine loop."""


EngineRequest = AddRequest | AbortRequests | Shutdown


# ---- engine -> server ---------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is loaded; what the server needs to serve it."""

    pid: int
    max_model_len: int
    tokenizer_dir: str | None  # None: the checkpoint has no tokenizer (token-id prompts only)
    default_sampling_params: dict
    stats: EngineStats


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str


class ChoiceDelta(msgspec.Struct, array_like=True):
    """What one choice adds in one step (`CompletionOutput` without its cumulative fields)."""

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None  # sent with the finished output only


class RequestFailure(msgspec.Struct, array_like=True):
    """A request the engine refused (`invalid`: the request's fault, a 400) or failed while running
    it (an engine error, a 500)."""

    request_id: str
    message: str
    invalid: bool
    param: str | None = None
    code: str | None = None


class EngineOutputs(msgspec.Struct, tag=True, array_like=True):
    """Everything one pass of the engine loop produced, and the statistics after it."""

    outputs: list[RequestDelta]
    failures: list[RequestFailure]
    stats: EngineStats


EngineMessage = Ready | StartupFailed | EngineOutputs


class Codec:
    """msgpack encoder and decoders for both directions (one instance per socket owner)."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.requests = msgspec.msgpack.Decoder(EngineRequest)
        self.messages = msgspec.msgpack.Decoder(EngineMessage)

    def encode(self, message: EngineRequest | EngineMessage) -> bytes:
        return self.encoder.encode(message)
