"""OpenAI's wire format: the request bodies we accept, their conversion to SamplingParams, and
the response, chunk, usage, logprob and error bodies we send.

Requests are validated in pydantic's strict mode: a field of the wrong type
(`"max_tokens": "5"`, `"stream": "yes"`) is a 400, as on api.openai.com, while unknown fields are
ignored, as vLLM does, so that clients written for either keep working.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gemma4serve.chat.messages import template_message, tool_calls_spec
from gemma4serve.engine.outputs import TokenLogprob
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.spec import StructuredOutputsParams

_SALT_FORBIDDEN = frozenset("@/\\\0")  # vLLM's rule for a cache_salt
TEXT_CONSTRAINTS = ("regex", "choice", "grammar")  # vLLM's constraints besides the JSON ones

# -------------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """A request the server refuses, carried to the HTTP layer as OpenAI's error body and a
    4xx/5xx status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# pydantic adds the union member it tried to an error's location ("stop", "list[str]"); these are
# not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_of(loc: tuple) -> str | None:
    parts = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p.lower() in _TYPE_TAGS or not p.isidentifier()):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def _validation_error(exc: ValidationError) -> ApiError:
    # A value that fits no member of a union fails each member: our own validators' words say
    # most ("this server is text-only"), else the deepest error does.
    errors = exc.errors(include_url=False)
    own = [e for e in errors if e["type"] == "value_error"]
    err = own[0] if own else max(errors, key=lambda e: len(e["loc"]))
    param = _param_of(err["loc"])
    if err["type"] == "missing":
        return ApiError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    message = err["msg"].removeprefix("Value error, ")
    code = (
        "invalid_value"
        if err["type"] in ("value_error", "literal_error", "greater_than_equal")
        else "invalid_type"
    )
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param, code=code)


# ------------------------------------------------------------------------------------------------
# Requests


# Numbers are finite (NaN or inf temperatures turn into NaN probabilities inside a batch shared with
# others).
class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable: a null is the field's default, as in vLLM."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(
                f"content parts of type '{self.type}' are not supported; this server is text-only"
            )
        if self.text is None:
            raise ValueError("a content part of type 'text' requires 'text' (a string)")
        return self


class ChatMessage(BaseModel):
    # Fields beyond OpenAI's (e.g. `reasoning_content`) are kept: the chat template may read them.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self):
        # An assistant turn may be empty (a refusal or a reasoning-only turn replayed).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def to_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if self.content is None and not self.tool_calls:
            message["content"] = ""
        return template_message(message)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage in every chunk


class _GenerationRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions. None = "not given": the
    server's default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's {"json": schema} / {"json_object": true} / {"regex"} / {"choice"} / {"grammar"}
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older spellings of the same
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's: logprobs name tokens "token_id:{id}" (None: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids
    cache_salt: str | None = None  # vLLM's: prefix-cache pages shared only within one salt
    truncation_side: Literal["left", "right"] = "left"  # vLLM's: which end truncation keeps
    # vLLM features this server does not have: refused rather than silently ignored
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None
    use_beam_search: bool = False
    repetition_detection: dict[str, Any] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, or None; ApiError(400) when malformed or
        when more than one is given (vLLM refuses those too)."""
        return _only_one(self._constraints())

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Every constraint the request gives, each with the field that gave it."""
        found = []
        if self.guided_json is not None:
            schema = _schema_text(self.guided_json, "guided_json")
            found.append(("guided_json", StructuredOutputsParams(json=schema)))
        for kind in TEXT_CONSTRAINTS:
            given = getattr(self, f"guided_{kind}")
            if given is not None:
                found.append((f"guided_{kind}", _text_constraint(kind, given, f"guided_{kind}")))
        outputs = dict(self.structured_outputs or {})
        compact = outputs.pop("disable_any_whitespace", False)  # an option of the JSON kinds
        if not isinstance(compact, bool):
            raise ApiError(
                400,
                "structured_outputs.disable_any_whitespace must be a boolean.",
                param="structured_outputs",
            )
        kinds = [key for key, value in outputs.items() if value is not None and value is not False]
        if outputs and (not kinds or not set(kinds) <= {"json", "json_object", *TEXT_CONSTRAINTS}):
            raise ApiError(
                400,
                "structured_outputs supports 'json', 'json_object', 'regex', 'choice' and "
                "'grammar' (and 'disable_any_whitespace' for the JSON ones) on this server.",
                param="structured_outputs",
            )
        for kind in kinds:
            if kind == "json":
                schema = _schema_text(outputs["json"], "structured_outputs")
                spec = StructuredOutputsParams(json=schema)
            elif kind == "json_object":
                spec = StructuredOutputsParams(json_object=True)
            else:
                spec = _text_constraint(kind, outputs[kind], "structured_outputs")
            found.append((f"structured_outputs.{kind}", spec))
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(
                    400,
                    "response_format json_schema needs a 'json_schema' object with a 'schema' "
                    "object.",
                    param="response_format",
                )
            schema = _schema_text(spec["schema"], "response_format")
            found.append(("response_format", StructuredOutputsParams(json=schema)))
        elif kind != "text":
            raise ApiError(
                400,
                f"response_format type '{kind}' is not supported; use 'text', 'json_object' or "
                "'json_schema'.",
                param="response_format",
            )
        if compact:  # the JSON kinds only: the other languages say their own whitespace
            if not any(_is_json(spec) for _, spec in found):
                raise ApiError(
                    400,
                    "structured_outputs.disable_any_whitespace needs a JSON constraint.",
                    param="structured_outputs",
                )
            found = [
                (name, replace(spec, any_whitespace=False) if _is_json(spec) else spec)
                for name, spec in found
            ]
        return found

    def check_supported(self) -> None:
        """Refuse what this server cannot honour rather than silently ignoring it."""
        unsupported = {  # values that ask for nothing (vLLM's "off") pass
            "thinking_token_budget": self.thinking_token_budget not in (None, -1),
            "logprob_token_ids": bool(self.logprob_token_ids),
            "use_beam_search": self.use_beam_search,
            "repetition_detection": bool((self.repetition_detection or {}).get("max_pattern_size")),
        }
        for name, given in unsupported.items():
            if given:
                raise ApiError(400, f"{name} is not supported by this server.", param=name)
        salt = self.cache_salt
        if salt is not None and not (0 < len(salt) <= 128 and not set(salt) & _SALT_FORBIDDEN):
            raise ApiError(  # vLLM's rule, so that a salt either server takes works on both
                400,
                "cache_salt must be a non-empty string of at most 128 characters without '@', "
                "'/', '\\' or NUL.",
                param="cache_salt",
            )
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options is only allowed when stream is true.", param="stream_options"
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (truncate == -1 or truncate >= 1):
            raise ApiError(
                400,
                "truncate_prompt_tokens must be -1 (the context length) or a positive count, "
                f"got {self.truncate_prompt_tokens}",
                param="truncate_prompt_tokens",
            )
        self.structured_outputs_params()  # a 400 for a malformed constraint
        if any(s == "" for s in self.stop_strings):
            raise ApiError(400, "stop strings must not be empty.", param="stop")

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's: usage in every chunk, only together with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(
        self, *, max_tokens: int, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """`defaults` (the checkpoint's generation_config, when the engine offers one) fill what
        the request leaves unset; then SamplingParams' own defaults. Raises ApiError(400) on
        values no sampler honours."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        chosen = {k: v for k, v in (defaults or {}).items() if k in given}
        chosen.update({k: v for k, v in given.items() if v is not None})
        try:
            # OpenAI's keys are token ids as strings; vLLM clamps the values to [-100, 100].
            logit_bias = {
                int(k): min(max(v, -100.0), 100.0) for k, v in (self.logit_bias or {}).items()
            }
        except ValueError:
            raise ApiError(
                400, "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
            ) from None
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                seed=self.seed,
                stop=self.stop_strings,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                n=self.n,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                min_tokens=self.min_tokens,
                logit_bias=logit_bias or None,
                prompt_logprobs=self.wanted_prompt_logprobs,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                structured_outputs=self.structured_outputs_params(),
                cache_salt=self.cache_salt,
                **chosen,
            )
        except ValueError as e:
            # SamplingParams' messages start with the field's name ("top_p must be in (0, 1], got
            # 0.0").
            field = str(e).split(" ", 1)[0]
            raise ApiError(
                400, str(e), param=field if field in SamplingParams.__dataclass_fields__ else None
            ) from e


class _ChatPrompt(_Request):
    """The fields that render chat messages into a prompt (chat completions and /tokenize)."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: leave the last (assistant) message open so that the model continues it
    continue_final_message: bool = False

    prompt_param: ClassVar[str] = "messages"  # the field a prompt error names

    def check_messages(self) -> None:
        if not self.messages:
            raise ApiError(
                400,
                "messages must contain at least one message.",
                param="messages",
                code="invalid_value",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )

    def template_messages(self) -> list[dict]:
        return [m.to_template() for m in self.messages]


class ChatCompletionRequest(_GenerationRequest, _ChatPrompt):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the response
    # OpenAI's; on Gemma 4 it turns thinking on ("none": off) unless enable_thinking is given
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )

    def check_supported(self) -> None:
        super().check_supported()
        self.check_messages()
        self.tool_calls_spec()  # a 400 for a malformed tool_choice
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ApiError(
                400,
                f"top_logprobs must be non-negative, got {self.top_logprobs}",
                param="top_logprobs",
            )

    @property
    def parses_tool_calls(self) -> bool:
        """vLLM: with tool_choice "none" the model's calls are not parsed (the tools are still
        in the prompt, as vLLM renders them unless --exclude-tools-when-tool-choice-none)."""
        return self.tool_choice != "none"

    def tool_calls_spec(self) -> StructuredOutputsParams | None:
        """The grammar that enforces tool_choice, or None; ApiError(400) as vLLM words it."""
        try:
            return tool_calls_spec(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as e:
            raise ApiError(400, str(e), param="tool_choice") from e

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A forced tool call's grammar wins over response_format, as in vLLM; beside any other
        constraint it is a 400, as in vLLM."""
        constraints = self._constraints()
        forced = self.tool_calls_spec()
        if forced is None:
            return _only_one(constraints)
        others = [name for name, _ in constraints if name != "response_format"]
        if others:
            raise ApiError(
                400,
                "You can only either use constraints for structured outputs or tools, not both.",
                param=others[0].split(".")[0],
            )
        return forced

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's legacy default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM extension: prepend <bos> to a text prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ApiError(
                400, "suffix (insertion) is not supported by this server.", param="suffix"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(
                400, "best_of other than n is not supported by this server.", param="best_of"
            )

    prompt_param: ClassVar[str] = "prompt"

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        # echo with logprobs shows the prompt's tokens with theirs (vLLM scores the prompt for it)
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation (max_tokens 0): the prompt and its logprobs alone, as
        prompt-scoring clients ask; the engine still runs one token, which is not shown."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token-id list, or a batch of them."""
        prompt = self.prompt
        batch = (
            prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
            else [prompt]
        )
        if any(len(one) == 0 for one in batch):
            raise ApiError(400, "prompt must not be empty.", param="prompt", code="invalid_value")
        return batch


class TokenizeCompletionRequest(_Request):
    """vLLM's /tokenize body for a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        pass


class TokenizeChatRequest(_ChatPrompt):
    """vLLM's /tokenize body for chat messages (the template writes <bos> itself)."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def check_supported(self) -> None:
        self.check_messages()


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_request(model: type[_Request], body: bytes) -> Any:
    """A request body -> a validated request model, or ApiError(400) that says what is wrong."""
    return validate_request(model, load_json_object(body))


def load_json_object(body: bytes) -> dict:
    """A request body -> its JSON object, or ApiError(400)."""
    try:
        data = json.loads(
            body, parse_constant=_no_constants
        )  # Python's json would take NaN and Infinity
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(
            400, "We could not parse the JSON body of your request. The body must be valid JSON."
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return data


def validate_request(model: type[_Request], data: dict) -> Any:
    """A JSON object -> a validated request model, or ApiError(400)."""
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check_supported()
    return request


# ------------------------------------------------------------------------------------------------
# Responses


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    def chat_completion(self, choices: list[dict], usage: dict) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def completion(self, choices: list[dict], usage: dict) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def chat_chunk(
        self, choices: list[dict], usage: dict | None = None, *, with_usage: bool = False
    ) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if (
            with_usage
        ):  # OpenAI: with include_usage, every chunk carries "usage" (null until the last)
            chunk["usage"] = usage
        return chunk

    def completion_chunk(
        self, choices: list[dict], usage: dict | None = None, *, with_usage: bool = False
    ) -> dict:
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            chunk["usage"] = usage
        return chunk


def chat_choice(
    index: int, message: dict | str, logprobs: dict | None, finish_reason, stop_reason
) -> dict:
    """`message`: the assistant message's fields, or just its content."""
    if isinstance(message, str):
        message = {"content": message}
    return {
        "index": index,
        "message": {"role": "assistant", **message},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta_choice(
    index: int, delta: dict, logprobs: dict | None = None, finish_reason=None, stop_reason=None
):
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason, stop_reason=None
) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


# ------------------------------------------------------------------------------------------------
# Logprobs

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > _LOGPROB_FLOOR else _LOGPROB_FLOOR


class TokenStrings:
    """Token id -> (text, UTF-8 bytes) as OpenAI's logprobs show a token. A byte-fallback piece
    (`<0xE2>`) shows its one raw byte, so that clients can reassemble multi-byte characters from
    `bytes`."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        # Tokens a response's text leaves out when skip_special_tokens is on.
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = getattr(self._tokenizer, "id_to_token", lambda _: None)(token_id)
            match = _BYTE_PIECE.match(piece) if piece else None
            if match:
                raw = bytes([int(match.group(1), 16)])
                hit = (raw.decode("utf-8", errors="replace"), list(raw))
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
                hit = (text, list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit


class TokenIdStrings:
    """vLLM's return_tokens_as_token_ids: logprobs show a token as "token_id:{id}", which keeps
    tokens that decode alike (byte-fallback pieces) apart."""

    def __init__(self, strings: TokenStrings):
        self.special_ids = strings.special_ids

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode("ascii"))


def chat_logprobs(logprobs: list[TokenLogprob], strings: TokenStrings) -> dict:
    """A chat completion's `choices[].logprobs`:
    {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        text, raw = strings(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def prompt_logprobs_body(
    prompt_logprobs: list[TokenLogprob | None], strings: TokenStrings
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the top ones."""

    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": strings(token_id)[0]}

    body = []
    for lp in prompt_logprobs:
        if lp is None:
            body.append(None)
            continue
        tokens = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            tokens.setdefault(str(token_id), entry(token_id, logprob, rank))
        body.append(tokens)
    return body


def echo_logprobs(
    prompt_ids: list[int],
    prompt_logprobs: list[TokenLogprob | None],
    strings: TokenStrings,
    skip_special_tokens: bool = True,
) -> dict:
    """The prompt's part of an echoed completion's `logprobs` (its first token has none)."""
    first, _ = strings(prompt_ids[0])
    skipped = skip_special_tokens and prompt_ids[0] in strings.special_ids
    body, _ = completion_logprobs(
        prompt_logprobs[1:], strings, 0 if skipped else len(first), skip_special_tokens
    )
    return {
        "tokens": [first, *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *body["text_offset"]],
    }


def completion_logprobs(
    logprobs: list[TokenLogprob],
    strings: TokenStrings,
    text_offset: int,
    skip_special_tokens: bool = True,
) -> tuple[dict, int]:
    """`choices[].logprobs` of a legacy completion, and the text offset after its last token.
    `top_logprobs` also holds the sampled token (OpenAI: "up to logprobs+1 elements");
    `text_offset` counts characters from the start of this choice's text, so a special token the
    text leaves out does not move it."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in logprobs:
        text, _ = strings(lp.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob))
        top = {strings(t)[0]: _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        if not (skip_special_tokens and lp.token_id in strings.special_ids):
            text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, text_offset


def _schema_text(schema: dict | str, param: str) -> str:
    """A JSON schema as JSON text (the grammar compiler checks the rest)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ApiError(
                400, f"the JSON schema is not valid JSON: {error}", param=param
            ) from None
    if not isinstance(schema, dict):
        raise ApiError(400, "the JSON schema must be an object.", param=param)
    return json.dumps(schema)


def _is_json(spec: StructuredOutputsParams) -> bool:
    return spec.json is not None or spec.json_object


def _only_one(
    constraints: list[tuple[str, StructuredOutputsParams]],
) -> StructuredOutputsParams | None:
    if len(constraints) > 1:
        names = [name for name, _ in constraints]
        raise ApiError(
            400,
            f"only one structured output constraint may be given, got {', '.join(names)}.",
            param=names[1].split(".")[0],
        )
    return constraints[0][1] if constraints else None


def _text_constraint(kind: str, given: Any, param: str) -> StructuredOutputsParams:
    """vLLM's regex (a string), choice (a non-empty list of strings) or grammar (a string); the
    grammar compiler checks the rest."""
    texts = given if kind == "choice" else [given]
    strings = isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)
    if not strings or (kind != "choice" and not given):  # a choice may be the empty string
        what = "a non-empty list of strings" if kind == "choice" else "a non-empty string"
        raise ApiError(400, f"{kind} must be {what}.", param=param)
    for text in texts:
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ApiError(400, f"{kind} holds a lone surrogate.", param=param) from None
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(given))
    return StructuredOutputsParams(**{kind: given})
