"""What a request's output must match (vLLM's StructuredOutputsParams, the JSON kinds): plain,
hashable data, so it crosses a process boundary and keys the compiled-grammar cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema as JSON text
    json_object: bool = False  # any JSON object (when `json` is None)
