"""The rules a prompt must satisfy, written once for the server and the engine.

The server turns a `RequestError` into OpenAI's 400 body (with `param` and `code`); the engine and
the offline API raise it as the ValueError it is.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request no engine can serve; `param` names the field at fault, `code` is OpenAI's code."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def with_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    """Gemma expects <bos> first: a text prompt gets it, as HF's tokenizer and vLLM do (an empty
    prompt stays empty, to be refused as such)."""
    if not ids or bos_token_id is None or ids[0] == bos_token_id:
        return ids
    return [bos_token_id, *ids]


def encode_text(tokenizer, text: str, *, param: str) -> list[int]:
    """Token ids of `text` without special tokens; invalid Unicode (JSON allows lone surrogates,
    the tokenizer does not) is the request's fault."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, UnicodeError) as e:
        raise RequestError(
            f"The {param} could not be tokenized (invalid Unicode?): {e}", param=param
        ) from e


def check_token_ids(ids: list[int], vocab_size: int, *, param: str = "prompt") -> None:
    """An id outside the embedding table would fault the model (on a GPU: a device assert)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size}).", param=param
        )


def check_context_length(
    prompt_len: int, max_tokens: int | None, max_model_len: int, *, prompt_param: str = "prompt"
) -> int:
    """The number of tokens to generate (all the room left when none was asked for); a prompt or
    prompt + max_tokens beyond the context is refused in OpenAI's and vLLM's words."""
    if prompt_len == 0:
        raise RequestError("The prompt is empty.", param=prompt_param, code="invalid_value")
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} "
            "in the completion). Please reduce the length of the input or of the completion "
            "(max_tokens).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
