"""`gemma4serve`: parse the command line (vLLM's spellings), build the engine, serve it over HTTP.

    gemma4serve --model google/gemma-4-31B-it --draft google/gemma-4-31B-it-assistant
    gemma4serve --demo          # a tiny random Gemma 4 and its assistant: runs anywhere

Startup prints the engine's progress (resolve/download, load, KV sizing, graph capture) and ends
with exactly one line `gemma4serve ready: http://HOST:PORT (model NAME)`. SIGTERM (or Ctrl-C)
drains: new requests get 503, running ones finish for up to --drain-timeout seconds, the rest are
aborted, and the process exits 0. A second Ctrl-C aborts the running requests at once (their
streams still end), a third skips the shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import sys
from pathlib import Path

from gemma4serve.engine.args import GENERATION_DEFAULTS, EngineArgs
from gemma4serve.engine_process import ITERATION_TIMEOUT_S
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.server.limits import RequestLimits
from gemma4serve.server.settings import (
    DEFAULT_MAX_LOGPROBS,
    RESERVED_TEMPLATE_KWARGS,
    CorsSettings,
    ServerSettings,
)
from gemma4serve.server.stats_log import INTERVAL_S as STATS_INTERVAL_S

logger = logging.getLogger("gemma4serve")

DEMO_MODEL_NAME = "gemma4serve-demo"
API_KEY_ENVS = ("GEMMA4SERVE_API_KEY", "VLLM_API_KEY")  # read in this order
DRAIN_TIMEOUT_ENV = "GEMMA4SERVE_DRAIN_TIMEOUT"  # the Docker image sets it to fit `docker stop`
LOG_STATS_INTERVAL_ENV = "GEMMA4SERVE_LOG_STATS_INTERVAL"  # vLLM's VLLM_LOG_STATS_INTERVAL
SHUTDOWN_BACKSTOP_S = 5.0  # after the drain timeout's aborts, how long aborted requests get to end
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and a supervisor's stop


# ----------------------------------------------------------------------------------------------
# Argument types


_SCALES = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_SCALES |= {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _human_int(text: str) -> int:
    """vLLM's human-readable integers: `32768`, `32k` or `2.5k` (x1000), `32K` (x1024); k, m, g
    and t count in thousands, K, M, G and T in 1024s; a decimal needs a thousands unit."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", text)
    if not match or ("." in match.group(1) and match.group(2) not in "kmgt"):
        raise argparse.ArgumentTypeError(f"expected a count like 8192, 8k or 8K, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _SCALES[unit])


def _human_int_or_auto(text: str) -> int | None:
    """vLLM's --max-model-len: a count, or auto / -1 for the default (None)."""
    return None if text.strip().lower() in ("auto", "-1") else _human_int(text)


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def _byte_size(text: str) -> int:
    """`17179869184`, `16GiB`, `16G` (both x1024^3) or `16GB` (x1000^3)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size like 16GiB, 16G or 17179869184, got {text!r}"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def _acceptance(text: str) -> float | list[float]:
    """`2.5` or a comma list `0.9,0.8,0.6`."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or a comma list of numbers, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def _count(minimum: int):
    """An int argument type that refuses values below `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


# ----------------------------------------------------------------------------------------------
# Parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Says a flag's default once: appended unless the help already states it, and never for
    flags whose default is "not given"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" not in text
            and action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


_EPILOG = """examples:
  gemma4serve google/gemma-4-31B-it --draft google/gemma-4-31B-it-assistant
  gemma4serve --demo --port 8000
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gemma4serve",
        description="An OpenAI-compatible server for Gemma 4 with MTP speculative decoding.\n"
        "Flags are spelled as in `vllm serve`.",
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="Hugging Face repo id or local directory of the target model (as `vllm serve "
        "MODEL`; or give --model).",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model", help="Hugging Face repo id or local directory of the target model."
    )
    model.add_argument(
        "--draft",
        help="Repo id or directory of the MTP assistant (drafter). "
        "Omit to serve without speculation.",
    )
    model.add_argument(
        "--demo",
        action="store_true",
        help="Serve the built-in tiny random Gemma 4 and its assistant (built on first use under "
        "$GEMMA4SERVE_CACHE, default ~/.cache/gemma4serve; any machine, CPU included).",
    )
    model.add_argument("--tokenizer", help="Tokenizer directory or repo id (default: the model's).")
    model.add_argument("--revision", help="Model revision (branch, tag or commit) on the Hub.")
    model.add_argument(
        "--download-dir",
        help="Where Hub checkpoints are downloaded and looked up (default: the Hugging Face "
        "cache, $HF_HOME).",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="Name(s) clients put in `model`; the first is the one reported (default: the "
        "model's path or repo id).",
    )
    model.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="How to load weights: auto/safetensors read the checkpoint; dummy = random weights "
        "of the real shapes (benchmarks).",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "half", "float32", "float"],
        help="Weight and activation dtype; auto = bfloat16 on CUDA, float32 on CPU.",
    )
    model.add_argument(
        "--quantization",
        "-q",
        metavar="METHOD",
        help="Refused: vLLM's quantization methods (fp8, awq, ...) change outputs; this server "
        "runs the checkpoint's weights in --dtype.",
    )
    model.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto"],
        help="Accepted for vLLM compatibility: the KV cache keeps the model's dtype (an fp8 "
        "cache would change outputs).",
    )
    model.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Accepted for vLLM compatibility: Gemma 4 needs no code from the checkpoint, and "
        "none is run.",
    )
    model.add_argument(
        "--seed", type=int, default=0, help="Seeds dummy weights and requests that give no seed."
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,FOLDER}",
        help="Where default sampling settings (temperature, top_p, top_k, min_p, "
        "repetition_penalty) come from: auto = the model's generation_config.json, vllm = none "
        "(vLLM's own defaults), or a folder holding a generation_config.json.",
    )
    model.add_argument(
        "--override-generation-config",
        type=_json_object,
        metavar="JSON",
        help="Default sampling settings over --generation-config's, e.g. "
        """'{"temperature": 0.5}' (the keys it lists, and presence_penalty, frequency_penalty).""",
    )
    model.add_argument(
        "--chat-template",
        help="The chat template: a file path, or the Jinja template itself "
        "(default: the tokenizer's).",
    )
    model.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help="Chat template variables for every chat request, under the request's own "
        """chat_template_kwargs, e.g. '{"enable_thinking": true}' to think by default.""",
    )

    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu."
    )
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="Split the model over N devices (GPUs 0..N-1, or N CPU processes), one process "
        "each, started by the server.",
    )
    engine.add_argument(
        "--disable-custom-all-reduce",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Tensor parallelism: NCCL for every all-reduce (default: a one-shot all-reduce "
        "through symmetric memory for small ones on CUDA).",
    )
    engine.add_argument(
        "--max-model-len",
        type=_human_int_or_auto,
        metavar="TOKENS",
        help="Context length (prompt + output), e.g. 32768, 32k (x1000) or 32K (x1024) "
        "(default, or auto / -1: the config's, capped by the KV cache).",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="Most sequences in the running batch (a cap: KV pages are drawn on demand).",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_human_int,
        default=EngineArgs.max_num_batched_tokens,
        help="Token budget of one engine step (longer prompts are prefilled in chunks).",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Accepted for vLLM compatibility: prompts are always prefilled in chunks.",
    )
    engine.add_argument(
        "--limit-mm-per-prompt",
        type=_json_object,
        metavar="JSON",
        help="Accepted for vLLM compatibility when every limit is 0 (vLLM's text-only "
        """setting, '{"image": 0, "audio": 0}'): this server serves text only.""",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.90,
        help="Fraction of GPU memory for weights, activations and the KV cache.",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        metavar="BYTES",
        help="Bytes for KV pages, e.g. 20GiB; overrides --gpu-memory-utilization.",
    )
    engine.add_argument(
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=_human_int,
        metavar="BYTES",
        help="vLLM's spelling of --kv-cache-memory, in its units (20g = 20e9, 20G = 20 x 2^30).",
    )
    # Test knob: an arena that holds this many positions.
    engine.add_argument("--kv-cache-tokens", type=int, help=argparse.SUPPRESS)
    engine.add_argument(
        "--page-size",
        "--block-size",
        dest="page_size",
        type=int,
        default=16,
        help="Positions per KV page of the sliding layers (vLLM calls a page a block); full-layer "
        "pages hold as many positions as fit the same bytes.",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV of earlier requests' prefixes (default: on).",
    )
    engine.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "flashinfer"],
        help="auto = Triton on CUDA, torch elsewhere. flashinfer: FlashInfer's prefill for the "
        "sliding layers of eager prompt steps (the flashinfer extra).",
    )
    engine.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Never capture CUDA graphs.",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Queue the next decode step before reading the current one's tokens, so host work "
        "overlaps the GPU (default: on).",
    )
    engine.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the engine in a process of its own, so that its steps never share the GIL with "
        "HTTP work (--no-engine-process: a thread of the server, for debugging; default: on).",
    )
    engine.add_argument(
        "--engine-iteration-timeout",
        type=_seconds,
        default=ITERATION_TIMEOUT_S,
        metavar="SECONDS",
        help="An engine that owes the server a step's results for this long is hung: it is "
        "killed, its requests fail and the server exits 1 (0 = never; default: %(default).0f).",
    )

    spec = p.add_argument_group("speculative decoding (MTP)")
    spec.add_argument(
        "--num-draft-tokens",
        "--num-speculative-tokens",
        dest="num_draft_tokens",
        type=int,
        metavar="K",
        help=f"Draft tokens per step; 0 turns MTP off (default: {EngineArgs.num_draft_tokens}).",
    )
    spec.add_argument(
        "--speculative-config",
        type=_json_object,
        metavar="JSON",
        help="vLLM's spelling of --draft and --num-draft-tokens: "
        '\'{"method": "mtp", "model": ASSISTANT, "num_speculative_tokens": K}\' '
        "(method may be left out).",
    )
    spec.add_argument(
        "--adaptive-draft-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Per step, propose k drafts, half of k or none, whichever yields the most tokens "
        "per second at the batch size from the measured acceptance rates (step costs are "
        "measured on the CUDA graphs at start; default: on).",
    )
    spec.add_argument(
        "--forced-acceptance",
        type=_acceptance,
        metavar="TOKENS",
        help="BENCHMARK ONLY: force the mean tokens per verify step (a number, or a comma list). "
        "Outputs are then NOT the model's.",
    )

    server = p.add_argument_group("HTTP server")
    server.add_argument(
        "--host",
        default="0.0.0.0",
        help="Address to listen on. 0.0.0.0 = every interface (what Docker needs); "
        "127.0.0.1 keeps the server local to this machine.",
    )
    server.add_argument(
        "--port", type=int, default=8000, help="Port to listen on (0 = any free port)."
    )
    server.add_argument(
        "--api-key",  # the env default is read in parse_args: --help must not print the key
        dest="api_keys",
        nargs="+",
        metavar="KEY",
        help="Require `Authorization: Bearer KEY` on /v1/*, any of the keys given (default: "
        f"${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]}, if set). The rest stays open (/health, "
        "/ping, /metrics, /version, /tokenize, /detokenize, /docs), as in vLLM, and so do CORS "
        "preflights.",
    )
    server.add_argument(
        "--root-path",
        default="",
        help="The path prefix under which a path-based proxy serves this server and which it "
        "strips before forwarding (e.g. /gemma); /docs and /openapi.json link with it "
        "(default: none).",
    )
    server.add_argument("--ssl-keyfile", help="Serve HTTPS with this private key (PEM).")
    server.add_argument("--ssl-certfile", help="Serve HTTPS with this certificate (PEM).")
    server.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=[],
        metavar="JSON",
        help='CORS: origins whose pages may call the API, a JSON list, e.g. ["*"] (default: '
        "none, as in vLLM: a web page cannot make a visitor's browser call this server).",
    )
    server.add_argument(
        "--allowed-methods",
        type=json.loads,
        default=["*"],
        metavar="JSON",
        help='CORS: HTTP methods allowed, a JSON list (default: ["*"]).',
    )
    server.add_argument(
        "--allowed-headers",
        type=json.loads,
        default=["*"],
        metavar="JSON",
        help='CORS: request headers allowed, a JSON list (default: ["*"]).',
    )
    server.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: allow credentials (cookies).",
    )
    server.add_argument(
        "--drain-timeout",
        "--shutdown-timeout",  # vLLM's name
        type=float,
        metavar="SECONDS",
        help="On SIGTERM, seconds to let running requests finish before aborting them "
        f"(default: ${DRAIN_TIMEOUT_ENV}, if set, else {ServerSettings.drain_timeout:.0f}). "
        f"Keep it {SHUTDOWN_BACKSTOP_S:.0f}s under the stop grace of whatever sends SIGTERM.",
    )

    api = p.add_argument_group("API")
    api.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help="Most logprobs (completions), top_logprobs (chat) or prompt_logprobs a request may "
        "ask for; -1 = no cap.",
    )
    api.add_argument(
        "--return-tokens-as-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Logprobs name tokens 'token_id:{id}' unless a request's return_tokens_as_token_ids "
        "says otherwise.",
    )
    api.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Every stream carries usage, in each chunk and a last one, whatever its "
        "stream_options say.",
    )
    api.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No /openapi.json and /docs (vLLM's name for the flag).",
    )
    always_on = {
        "--enable-prompt-tokens-details": "usage's prompt_tokens_details.cached_tokens",
        "--enable-request-id-headers": "the X-Request-Id echo",
    }
    for flag, what in always_on.items():  # no --no- form: it could not be honoured
        api.add_argument(
            flag, action="store_true", help=f"Accepted for vLLM compatibility: {what} is always on."
        )
    limits = p.add_argument_group(
        "request limits",
        "Bounds on what one request may ask for; past one, the request gets a 400.",
    )
    limits.add_argument(
        "--max-request-body-bytes",
        type=_byte_size,
        default="32MiB",  # RequestLimits' default, as a person writes it
        help="Largest request body, e.g. 8MiB (a larger one gets a 413 before it is parsed).",
    )
    limits.add_argument(
        "--max-stop-sequences",
        type=_count(0),
        default=RequestLimits.max_stop_sequences,
        help="Most entries in a request's `stop`, in its `stop_token_ids`, in its `bad_words`.",
    )
    limits.add_argument(
        "--max-stop-chars",
        type=_count(0),
        default=RequestLimits.max_stop_chars,
        help="Most characters over all of a request's stop strings, and over its bad words.",
    )
    limits.add_argument(
        "--max-n",
        type=_count(1),
        default=RequestLimits.max_n,
        help="Most choices (`n`) per request.",
    )
    limits.add_argument(
        "--max-choices",
        type=_count(1),
        default=RequestLimits.max_choices,
        help="Most choices per request: `n` times the number of prompts of a batched completion.",
    )
    limits.add_argument(
        "--max-messages",
        type=_count(1),
        default=RequestLimits.max_messages,
        help="Most messages in a chat request.",
    )
    # Chat completions always split Gemma 4's reasoning and tool calls out of the text; vLLM's
    # switches for that are accepted so that vLLM command lines run unchanged.
    api.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",  # no --no- form: calls are always parsed
        help="Accepted for vLLM compatibility: tool calls are always parsed.",
    )
    api.add_argument(
        "--tool-call-parser",
        choices=["gemma4"],
        help="Accepted for vLLM compatibility: Gemma 4's tool-call parser is always on.",
    )
    api.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="As vLLM: leave the tools out of the prompt of a request with tool_choice "
        '"none" (by default they are rendered, and no calls are parsed).',
    )
    api.add_argument(
        "--reasoning-parser",
        choices=["gemma4"],
        help="Accepted for vLLM compatibility: Gemma 4's reasoning parser is always on.",
    )

    logs = p.add_argument_group("logging")
    logs.add_argument(
        "--log-level",
        default="info",
        type=str.lower,  # vLLM spells the levels in capitals
        choices=_LOG_LEVELS,
        help="Level of gemma4serve's own log.",
    )
    logs.add_argument(
        "--uvicorn-log-level",
        default="info",
        type=str.lower,
        choices=_LOG_LEVELS + ["trace"],
        help="Level of uvicorn's log (warning and above hide the line per HTTP request).",
    )
    logs.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No line per HTTP request.",
    )
    logs.add_argument(
        "--metrics-prefix",
        default=ServerSettings.metrics_prefix,
        metavar="NAME",
        help="/metrics names are NAME:x (vLLM's names with our prefix); `vllm` gives vLLM's own, "
        "for the dashboards, autoscalers and `vllm bench serve` reports that look for them.",
    )
    logs.add_argument(
        "--disable-log-stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No stats line (throughput, running and waiting requests, KV use, prefix-cache hits, "
        f"drafts accepted) every ${LOG_STATS_INTERVAL_ENV} seconds (default "
        f"{STATS_INTERVAL_S:.0f}) while there is work.",
    )
    logs.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log each generation request: its id, prompt size and sampling settings.",
    )
    logs.add_argument(
        "--disable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Accepted for vLLM compatibility: requests are not logged unless "
        "--enable-log-requests is given.",
    )
    return p


_LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        draft=ns.draft,
        tokenizer=ns.tokenizer,
        revision=ns.revision,
        download_dir=ns.download_dir,
        generation_config=ns.generation_config,
        override_generation_config=ns.override_generation_config,
        dtype=_DTYPE_ALIASES.get(ns.dtype, ns.dtype),
        device=ns.device,
        tensor_parallel_size=ns.tensor_parallel_size,
        load_format="auto" if ns.load_format == "safetensors" else ns.load_format,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        page_size=ns.page_size,
        num_draft_tokens=ns.num_draft_tokens,
        adaptive_draft_length=ns.adaptive_draft_length,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory=ns.kv_cache_memory,
        kv_cache_tokens=ns.kv_cache_tokens,
        attention_backend=ns.attention_backend,
        enforce_eager=ns.enforce_eager,
        disable_custom_all_reduce=ns.disable_custom_all_reduce,
        enable_prefix_caching=ns.enable_prefix_caching,
        async_scheduling=ns.async_scheduling,
        seed=ns.seed,
        forced_acceptance=ns.forced_acceptance,
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
    )


def _is_string_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def server_settings(ns: argparse.Namespace, served_model_names: list[str]) -> ServerSettings:
    return ServerSettings(
        served_model_names=served_model_names,
        api_keys=ns.api_keys,
        drain_timeout=ns.drain_timeout,
        cors=CorsSettings(
            allowed_origins=ns.allowed_origins,
            allowed_methods=ns.allowed_methods,
            allowed_headers=ns.allowed_headers,
            allow_credentials=ns.allow_credentials,
        ),
        limits=request_limits(ns),
        max_logprobs=ns.max_logprobs,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        log_requests=ns.enable_log_requests,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        default_chat_template_kwargs=ns.default_chat_template_kwargs or {},
        log_stats_interval=ns.log_stats_interval,
        metrics_prefix=ns.metrics_prefix,
        openapi_docs=not ns.disable_fastapi_docs,
        force_include_usage=ns.enable_force_include_usage,
    )


def request_limits(ns: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_request_body_bytes=ns.max_request_body_bytes,
        max_stop_sequences=ns.max_stop_sequences,
        max_stop_chars=ns.max_stop_chars,
        max_n=ns.max_n,
        max_choices=ns.max_choices,
        max_messages=ns.max_messages,
    )


def _apply_speculative_config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """--speculative-config as vLLM serves a Gemma 4 assistant with it: its `model` becomes
    --draft and its `num_speculative_tokens` --num-draft-tokens; other methods and keys are
    refused, never ignored."""
    config = ns.speculative_config
    unknown = sorted(set(config) - {"method", "model", "num_speculative_tokens"})
    if unknown:
        parser.error(
            f"--speculative-config: {', '.join(unknown)} not supported; this server speculates "
            "with a Gemma 4 assistant only (method, model, num_speculative_tokens)"
        )
    if config.get("method", "mtp") not in ("mtp", "gemma4_mtp"):  # vLLM's older name
        parser.error(
            f"--speculative-config: method {config['method']!r} not supported; this server "
            'speculates with a Gemma 4 assistant only ("mtp")'
        )
    draft, drafts = config.get("model"), config.get("num_speculative_tokens")
    if not isinstance(draft, str) or not draft:
        parser.error('--speculative-config needs the assistant checkpoint as "model"')
    if drafts is not None and (type(drafts) is not int or drafts < 1):
        parser.error("--speculative-config: num_speculative_tokens must be a positive integer")
    if ns.draft not in (None, draft):
        parser.error("the assistant is given twice, by --draft and --speculative-config; give one")
    if None not in (ns.num_draft_tokens, drafts) and ns.num_draft_tokens != drafts:
        parser.error(
            "the draft count is given twice, by --num-draft-tokens and --speculative-config's "
            "num_speculative_tokens; give one"
        )
    ns.draft = draft
    if drafts is not None:
        ns.num_draft_tokens = drafts


def _vllm_spelling(argv: list[str]) -> list[str]:
    """vLLM's parser takes `--max_model_len` for `--max-model-len`; so does this one."""
    spelled = []
    for arg in argv:
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            arg = name.replace("_", "-") + equals + value
        spelled.append(arg)
    return spelled


def _api_keys(given: list[str] | None) -> list[str]:
    """The keys given, else the environment's; an empty one is dropped (it would let in a bearer
    token of nothing), as vLLM drops it."""
    keys = [key for key in given or () if key]
    if keys:
        return keys
    from_env = next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
    return [from_env] if from_env else []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(_vllm_spelling(sys.argv[1:] if argv is None else argv))
    ns.api_keys = _api_keys(ns.api_keys)
    if ns.quantization is not None:
        parser.error(
            f"--quantization {ns.quantization}: this server runs bf16, float16 or float32 "
            "weights only (a quantized model changes outputs); leave the flag out"
        )
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        parser.error(
            f"the model is given twice, as MODEL ({ns.model_tag}) and --model ({ns.model}); "
            "give one"
        )
    ns.model = ns.model or ns.model_tag
    if ns.speculative_config is not None:
        _apply_speculative_config(parser, ns)
    if ns.num_draft_tokens is None:
        ns.num_draft_tokens = EngineArgs.num_draft_tokens
    if ns.demo and (ns.model or ns.draft):
        parser.error("--demo serves the built-in tiny model; leave out MODEL/--model and --draft")
    if not ns.demo and not ns.model:
        hint = ""
        if len(ns.api_keys) > 1 or len(ns.served_model_name or ()) > 1:
            hint = " (--api-key and --served-model-name take several values: put MODEL first)"
        parser.error(
            f"a model is required: gemma4serve MODEL (or --demo for the built-in one){hint}"
        )
    if ns.port < 0 or ns.port > 65535:
        parser.error(f"--port must be in 0..65535, got {ns.port}")
    if ns.drain_timeout is None:
        try:
            ns.drain_timeout = float(
                os.environ.get(DRAIN_TIMEOUT_ENV, ServerSettings.drain_timeout)
            )
        except ValueError:
            parser.error(f"${DRAIN_TIMEOUT_ENV} must be a number of seconds")
    if ns.drain_timeout < 0:
        parser.error("--drain-timeout must not be negative")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", ns.metrics_prefix):
        parser.error(f"--metrics-prefix {ns.metrics_prefix!r}: letters, digits and _ only")
    ns.log_stats_interval = None
    if not ns.disable_log_stats:
        try:
            ns.log_stats_interval = _seconds(
                os.environ.get(LOG_STATS_INTERVAL_ENV, str(STATS_INTERVAL_S))
            )
        except (ValueError, argparse.ArgumentTypeError):
            parser.error(f"${LOG_STATS_INTERVAL_ENV} must be a number of seconds")
    # vLLM skips a null; a value that is not a number would fail every request that takes it.
    override = {k: v for k, v in (ns.override_generation_config or {}).items() if v is not None}
    unknown = sorted(set(override) - set(GENERATION_DEFAULTS))
    if unknown:
        parser.error(
            f"--override-generation-config: {', '.join(unknown)} not supported; give "
            f"{', '.join(GENERATION_DEFAULTS)}"
        )
    try:
        if any(type(value) not in (int, float) for value in override.values()):
            raise ValueError("the values must be numbers")
        SamplingParams(**override)
    except ValueError as e:
        parser.error(f"--override-generation-config: {e}")
    ns.override_generation_config = override
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & (ns.default_chat_template_kwargs or {}).keys())
    if reserved:
        parser.error(f"--default-chat-template-kwargs may not set {reserved}")
    limits = ns.limit_mm_per_prompt
    # vLLM takes a count, or {"count": N, ...} in its newer form.
    if limits is not None and any(
        (limit.get("count") if isinstance(limit, dict) else limit) != 0 for limit in limits.values()
    ):
        parser.error(
            f"--limit-mm-per-prompt {json.dumps(limits)}: this server serves text only; "
            """give every limit as 0 ('{"image": 0, "audio": 0}') or leave the flag out"""
        )
    if ns.max_logprobs < -1:
        parser.error("--max-logprobs must be -1 (no cap) or a count")
    if bool(ns.ssl_keyfile) != bool(ns.ssl_certfile):
        parser.error("--ssl-keyfile and --ssl-certfile go together")
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        if not _is_string_list(getattr(ns, flag)):
            parser.error(f"--{flag.replace('_', '-')} must be a JSON list of strings")
    if ns.root_path and not (ns.root_path.startswith("/") and not ns.root_path.endswith("/")):
        parser.error("--root-path must start with / and not end with one, e.g. /gemma")
    if ns.generation_config not in ("auto", "vllm"):
        folder = Path(ns.generation_config)
        if not (folder / "generation_config.json").is_file():
            parser.error(
                f"--generation-config {ns.generation_config}: no generation_config.json there "
                "(give auto, vllm or a folder that holds one)"
            )
    if ns.chat_template is not None:
        try:
            ns.chat_template = load_chat_template(ns.chat_template)
        except OSError as e:
            parser.error(f"--chat-template: {e}")
    return ns


def load_chat_template(value: str) -> str:
    """vLLM's rule: a value with Jinja's characters ({, } or a newline) is the template itself,
    anything else a path to read."""
    if any(ch in value for ch in "{}\n"):
        return value
    return Path(value).expanduser().read_text()


# ----------------------------------------------------------------------------------------------
# Serving


class _DropUvicornBanner(logging.Filter):
    """Drops uvicorn's "Uvicorn running on ...": ours is the one line that says where we listen."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Uvicorn running on")


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.error").addFilter(_DropUvicornBanner())


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts (as vLLM binds first): a port in use
    fails at once, not after the model has loaded. Port 0 takes a free one. IPv6 where the host
    has a colon, as uvicorn decides."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    engine,
    settings: ServerSettings,
    *,
    sock: socket.socket,
    host: str,
    log_level: str = "info",
    access_log: bool = True,
    root_path: str = "",
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
) -> None:
    """Serve `engine` on `sock` (`listening_socket`; `host` names it in the ready line) until
    SIGTERM/SIGINT, then drain and return (the caller exits 0). Blocks; call it from the main
    thread (signals are delivered there). `log_level` is uvicorn's."""
    import uvicorn

    from gemma4serve.server.app import build_app

    app = build_app(engine, settings)
    scheme = "https" if ssl_certfile else "http"
    state = app.state.gemma4serve

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1]
                url = _url(host, bound, scheme)
                name = settings.served_model_names[0]
                print(f"gemma4serve ready: {url} (model {name})", flush=True)

        @contextlib.contextmanager
        def capture_signals(self):
            # Ours stay installed until serve ignores the signals at its end: uvicorn's would put
            # Python's back while the event loop closes, and a Ctrl-C then would end the process
            # by SIGINT instead of exit 0.
            for sig in STOP_SIGNALS:
                signal.signal(sig, self.handle_exit)
            yield

        def handle_exit(self, sig, frame):
            # Not super(): uvicorn would close the listener at once (new clients get connection
            # refused, not the 503 of a drain) and re-raise the signal after its shutdown (exit
            # 143). The app drains with the listener open, then sets should_exit; we exit 0.
            if state.draining:
                if sig != signal.SIGINT:
                    return
                # Ctrl-C again: abort the running requests (their streams still end with
                # [DONE]) and shut down as usual; a third time: stop at once, skipping the
                # app's shutdown (uvicorn's force exit).
                if state.drain_cut:
                    self.should_exit = self.force_exit = True
                else:
                    logger.info("SIGINT again: aborting the running requests")
                    state.cut_drain()
                return
            logger.info(
                "%s: draining (up to %.0fs for running requests)",
                signal.Signals(sig).name,
                settings.drain_timeout,
            )
            state.begin_drain()
            if not self.started:  # nothing to drain yet: stop starting
                self.should_exit = True

    config = uvicorn.Config(
        app,
        log_level=log_level,
        log_config=None,  # keep our logging setup
        access_log=access_log,
        root_path=root_path,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        # uvicorn shuts down once the app's drain is over (and its aborts sent): this bounds
        # how long the aborted streams get to end.
        timeout_graceful_shutdown=SHUTDOWN_BACKSTOP_S,
        lifespan="on",
    )
    server = Server(config)
    state.on_drained = lambda: setattr(server, "should_exit", True)
    # A dead engine fails its requests at once; the server then stops (non-zero exit, as vLLM).
    engine.on_dead = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    finally:
        # Stopped, and the process exits next: a late Ctrl-C is ignored, not left to the handlers
        # Python resets to the default while it finalizes (death by SIGINT instead of exit 0).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        state.stop_engine(
            drain_timeout=0.0
        )  # no-op after a normal shutdown; stops the engine after a forced exit


class StartupStopped(BaseException):
    """SIGINT or SIGTERM while the engine starts (a load takes minutes): a BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.signal = signal.Signals(sig)


def _stop_starting(sig, frame):
    raise StartupStopped(sig)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    setup_logging(ns.log_level)
    try:
        sock = listening_socket(ns.host, ns.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", ns.host, ns.port, e.strerror or e)
        return 1
    if ns.demo:
        from gemma4serve.demo.checkpoints import ensure_demo_model

        logger.info("--demo: preparing the tiny random Gemma 4 and its assistant")
        ns.model, ns.draft = (str(p) for p in ensure_demo_model())
        logger.info("--demo: serving %s with its assistant %s", ns.model, ns.draft)
        ns.served_model_name = ns.served_model_name or [DEMO_MODEL_NAME]
    args = engine_args(ns)
    if ns.disable_log_requests:
        logger.info("--disable-log-requests: requests are only logged with --enable-log-requests")
    if args.forced_acceptance is not None:
        logger.warning(
            "!!! --forced-acceptance %s: BENCHMARK MODE. Acceptance is forced, so the outputs "
            "are NOT the model's. Never serve users like this. !!!",
            args.forced_acceptance,
        )
    logger.info("starting: model=%s draft=%s device=%s", args.model, args.draft, args.device)

    from gemma4serve.engine_process.client import EngineProcessClient, EngineStartupError

    stops = {sig: signal.signal(sig, _stop_starting) for sig in STOP_SIGNALS}
    try:
        engine = EngineProcessClient(
            args,
            in_process=not ns.engine_process,
            log_level=ns.log_level,
            iteration_timeout=ns.engine_iteration_timeout,
        )
    except EngineStartupError as e:  # bad path, no GPU, out of memory...: one clear line
        logger.error("could not start the engine: %s", e)
        return 1
    except StartupStopped as e:  # the engine is already stopped
        logger.info("%s while the engine was starting: stopped", e.signal.name)
        return 128 + e.signal  # the shell's status for a process ended by that signal
    finally:
        for sig, handler in stops.items():
            signal.signal(sig, handler)
    if ns.chat_template is not None:
        if engine.tokenizer is None:
            logger.error("--chat-template: this model has no tokenizer")
            return 1
        engine.tokenizer.chat_template = ns.chat_template
    serve(
        engine,
        server_settings(ns, served_model_names=ns.served_model_name or [engine.model_name]),
        sock=sock,
        host=ns.host,
        log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_uvicorn_access_log,
        root_path=ns.root_path,
        ssl_keyfile=ns.ssl_keyfile,
        ssl_certfile=ns.ssl_certfile,
    )
    if engine.dead:
        logger.error("stopped: the engine failed")
        return 1
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
