"""OpenAI chat messages and tools as the Gemma 4 chat template reads them (server, offline API)."""

from __future__ import annotations

import copy
import json


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
