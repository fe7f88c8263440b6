"""OpenAI chat messages and tools as the Gemma 4 chat template reads them (server, offline API)."""

from __future__ import annotations

import copy
import json

from gemma4serve.structured.spec import StructuredOutputsParams


def template_message(message: dict) -> dict:
    """The dict the chat template sees: text parts joined into one string (vLLM's "string"
    content format: the Gemma templates trim a system message's content as a string), and each
    call's `arguments` JSON string parsed into the mapping the template writes in its notation
    (it would paste a string verbatim, and the prompt would differ from what the model learnt)."""
    message = copy.deepcopy(message)
    if isinstance(message.get("content"), list):
        message["content"] = "\n".join(part["text"] for part in message["content"])
    for call in message.get("tool_calls") or ():
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            function["arguments"] = _arguments_mapping(function["arguments"])
    return message


def _arguments_mapping(arguments: str):
    """Anything but a JSON object stays as it is."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def tool_schemas(tools: list[dict] | None) -> dict[str, dict | None]:
    """Each function tool's parameters schema by name (what types its call's arguments)."""
    return {
        tool["function"]["name"]: tool["function"].get("parameters")
        for tool in tools or ()
        if isinstance(tool.get("function"), dict) and "name" in tool["function"]
    }


def forced_tools(tools: list[dict] | None, tool_choice) -> list[dict] | None:
    """The tools a grammar makes the output call (tool_choice "required": any of them; a named
    function: that one) as [{"name", "parameters"}], None when nothing is forced; ValueError as
    vLLM words it for a tool_choice it refuses."""
    if tool_choice is None or tool_choice == "none":
        return None
    if tools is None:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    schemas = tool_schemas(tools)
    if tool_choice == "auto":
        return None
    if tool_choice == "required":  # OpenAI: "required" without tools behaves as "none"
        return [{"name": name, "parameters": p} for name, p in schemas.items()] or None
    if not isinstance(tool_choice, dict):
        raise ValueError(
            f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", '
            '"auto" or "required" are supported.'
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise ValueError(
            f"Invalid value for `tool_choice`: {tool_choice}! Correct usage: "
            '`{"type": "function", "function": {"name": "my_function"}}`'
        )
    if name not in schemas:
        raise ValueError(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
            "specified `tools`."
        )
    return [{"name": name, "parameters": schemas[name]}]


def tool_calls_spec(
    tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None
) -> StructuredOutputsParams | None:
    """The grammar spec that enforces tool_choice, or None (nothing forced). A named function
    is called once, as vLLM's named tool_choice does; "required" allows several calls unless
    parallel_tool_calls is false."""
    forced = forced_tools(tools, tool_choice)
    if forced is None:
        return None
    return StructuredOutputsParams(
        tool_calls=json.dumps(forced, sort_keys=True),
        parallel_tool_calls=tool_choice == "required" and parallel_tool_calls is not False,
    )
