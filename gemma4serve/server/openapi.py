"""/openapi.json and /docs: the API described from the request models the server validates with.

The schemas come from the pydantic models themselves, so the document cannot drift from what the
server accepts; a client generator or a schema-driven fuzzer can use it as is.
"""

from __future__ import annotations

import functools

from pydantic.json_schema import models_json_schema

from gemma4serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

OPENAPI_VERSION = "3.1.0"

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _json_body(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: int) -> dict:
    return {str(s): _json_body(_ref("ErrorResponse"), "Error") for s in statuses}


def _post(summary: str, request: dict, response: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": _json_body({"type": "object"}, response),
                **_errors(400, 401, 404, 413, 503),
            },
        }
    }


def _get(summary: str, response: str, content_type: str = "application/json") -> dict:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": response, "content": {content_type: {}}}},
        }
    }


@functools.cache
def openapi_document(version: str) -> dict:
    """The OpenAPI 3.1 document of this server (built once; `servers` is added per request)."""
    models = [
        ChatCompletionRequest,
        CompletionRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
    ]
    _, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    schemas = dict(definitions.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    tokenize = {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "gemma4serve", "version": version},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion", _ref("ChatCompletionRequest"), "A chat completion, or SSE"
            ),
            "/v1/completions": _post(
                "Completion", _ref("CompletionRequest"), "A text completion, or SSE"
            ),
            "/tokenize": _post("Tokenize a prompt or chat messages", tokenize, "Token ids"),
            "/detokenize": _post("Token ids to text", _ref("DetokenizeRequest"), "The text"),
            "/v1/models": _get("The served models", "A list of models"),
            "/v1/models/{model}": {
                "get": {
                    "summary": "One served model",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {"200": _json_body({"type": "object"}, "A model"), **_errors(404)},
                }
            },
            "/health": _get("200 once the model is loaded, 503 while starting or draining", "OK"),
            "/metrics": _get("Prometheus metrics", "Metrics", "text/plain"),
            "/version": _get("The server's version", "The version"),
        },
        "components": {"schemas": schemas},
    }


def docs_page(openapi_url: str) -> str:
    """Swagger UI over `openapi_url` (its script and style load from the jsDelivr CDN, as
    FastAPI's /docs does; offline, the page still links the document)."""
    return f"""<!DOCTYPE html>
<html>
<head>
<title>gemma4serve - API docs</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head>
<body>
<p><a href="{openapi_url}">{openapi_url}</a></p>
<div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>
SwaggerUIBundle({{url: "{openapi_url}", dom_id: "#swagger-ui"}});
</script>
</body>
</html>
"""
