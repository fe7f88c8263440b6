"""The messages between the server process and the engine process, and their msgpack codec.

Requests carry `SamplingParams` whole and outputs are the engine's own `RequestOutput`s, so a
field added to either crosses without changes here (the codec encodes dataclasses field by field;
a field must stay msgpack-encodable). One `EngineOutputs` per engine step holds every request's
output: its new token ids only (the engine does not detokenize); the server's `OutputProcessor`
makes the text, finds stop strings (sending back `StopChoices`) and rebuilds the cumulative fields.
"""

from __future__ import annotations

import msgspec

from gemma4serve.engine.output_processor import StopChoice
from gemma4serve.engine.outputs import EngineStats, RequestOutput
from gemma4serve.sampling_params import SamplingParams

# ---- server -> engine ---------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # time.monotonic() (system-wide) when the server sent it: the engine takes requests between
    # steps, so one may wait a whole step first, and its queue time and TTFT must count that wait.
    arrival_time: float


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopChoices(msgspec.Struct, tag=True, array_like=True):
    """Choices that stop strings ended in the server's text: the engine finishes them."""

    stops: list[StopChoice]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what runs and end the engine loop."""


EngineRequest = AddRequest | AbortRequests | StopChoices | Shutdown


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


class RequestFailure(msgspec.Struct, array_like=True):
    """A request the engine refused (`invalid`: the request's fault, a 400) or failed while running
    it (an engine error, a 500)."""

    request_id: str
    message: str
    invalid: bool
    param: str | None = None
    code: str | None = None


class EngineOutputs(msgspec.Struct, tag=True, array_like=True):
    """Everything one pass of the engine loop produced, and the statistics after it.

    `messages_taken` (every message the engine has read so far) and `unfinished` (it has requests
    left, so another pass follows at once) tell the server whether another message is due: the
    engine sends one after every pass, and passes whenever it has requests or messages to read."""

    outputs: list[RequestOutput]
    failures: list[RequestFailure]
    stats: EngineStats
    messages_taken: int
    unfinished: bool


EngineMessage = Ready | StartupFailed | EngineOutputs


class Codec:
    """msgpack encoder and decoders for both directions (one instance per socket owner)."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.requests = msgspec.msgpack.Decoder(EngineRequest)
        self.messages = msgspec.msgpack.Decoder(EngineMessage)

    def encode(self, message: EngineRequest | EngineMessage) -> bytes:
        return self.encoder.encode(message)
