"""What a request's output must match (vLLM's StructuredOutputsParams: the JSON kinds, a regex, a
choice, a grammar, and the tool calls that `tool_choice` forces): plain, hashable data, so it
crosses a process boundary and keys the compiled-grammar cache."""

from __future__ import annotations

from dataclasses import dataclass

# Where the output may think before the constrained part (docs/gemma4.md §13.1).
NO_THINKING = "none"  # the constrained part starts at once
MAY_THINK = "optional"  # one thought channel may come first (thinking is on)
IN_THOUGHT = "open"  # the prompt left a channel open: the output starts inside it


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema as JSON text
    json_object: bool = False  # any JSON object (when `json` is None)
    regex: str | None = None  # the whole answer matches it
    choice: tuple[str, ...] | None = None  # the answer is one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's, GBNF-like) with a `root` rule
    # Gemma tool calls: a JSON list of {"name", "parameters"}, the tools the calls may use
    tool_calls: str | None = None
    parallel_tool_calls: bool = False  # with tool_calls: one or more calls, else exactly one
    thinking: str = NO_THINKING  # NO_THINKING, MAY_THINK or IN_THOUGHT
    # The JSON kinds: bounded whitespace between tokens, or none (vLLM's disable_any_whitespace)
    any_whitespace: bool = True

    def __post_init__(self):
        if self.choice is not None:  # vLLM's callers give a list; the spec must stay hashable
            object.__setattr__(self, "choice", tuple(self.choice))
