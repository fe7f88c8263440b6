"""The HTTP layer's settings, one typed object: the CLI builds it from its flags, `build_app`
takes it, and the routes read it through the server state."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemma4serve.server.limits import RequestLimits

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
# Template variables chat_template_kwargs must not set: they come from the request's own fields.
RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
}


@dataclass
class CorsSettings:
    """vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials."""

    allowed_origins: list[str] = field(default_factory=list)  # none: no cross-origin pages
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerSettings:
    """The CLI's flags (`gemma4serve --help`), most under the same name."""

    served_model_names: list[str]  # the first is the one /metrics labels and "model" defaults to
    api_keys: list[str] = field(default_factory=list)  # --api-key: /v1 takes any; none: open
    drain_timeout: float = 30.0  # after SIGTERM, seconds running requests get to finish
    cors: CorsSettings = field(default_factory=CorsSettings)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1 = no cap
    return_tokens_as_token_ids: bool = False  # a request's default for its field
    log_requests: bool = False  # one log line per request: its id, prompt size and settings
    exclude_tools_when_tool_choice_none: bool = False  # such prompts get no tools
    # what a request's chat_template_kwargs leave unset
    default_chat_template_kwargs: dict = field(default_factory=dict)
    log_stats_interval: float | None = None  # seconds between stats lines in the log; None: none
    metrics_prefix: str = "gemma4serve"  # /metrics names are `{metrics_prefix}:x`
    openapi_docs: bool = True  # serve /openapi.json and /docs (not --disable-fastapi-docs)
    # --enable-force-include-usage: usage in every chunk of every stream and a last one
    force_include_usage: bool = False

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        # an empty key would let in a bearer token of nothing; a bare string, each character
        if isinstance(self.api_keys, str) or not all(self.api_keys):
            raise ValueError("api_keys must be a list of non-empty keys")
        reserved = RESERVED_TEMPLATE_KWARGS & self.default_chat_template_kwargs.keys()
        if reserved:
            raise ValueError(f"default_chat_template_kwargs may not set {sorted(reserved)}")
