"""A multi-turn chat workload over HTTP, with prefix caching on and off: TTFT by turn, hit rate.

Starts the real server (or uses --url), then runs `--users` conversations at once. Every user
shares one system prompt; each turn sends the whole history (system prompt, earlier user messages
and the model's own earlier replies, as token ids) plus a new user message, streams the reply with
`ignore_eos`, and appends it. Prompts are random token ids sent to /v1/completions with vLLM's
`return_token_ids`, so the history is exactly what the model wrote (no tokenizer needed).

python bench/bench_multiturn.py --model configs/gemma-4-31B-it \\
    --draft configs/gemma-4-31B-it-assistant --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from request_timing import percentile
from server_process import start_server


@dataclass
class Turn:
    user: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float  # seconds to the first output token
    seconds: float


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def converse(url: str, model: str, user: int, system: list[int], args) -> list[Turn]:
    rng = random.Random(1000 + user)
    history = list(system)
    turns = []
    with httpx.Client(timeout=600) as client:
        for turn in range(args.turns):
            message = [
                rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.user_tokens)
            ]
            prompt = history + message
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.reply_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            start = time.perf_counter()
            ttft, reply, usage = None, [], {}
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    for choice in event.get("choices", []):
                        if choice.get("token_ids"):
                            ttft = ttft if ttft is not None else time.perf_counter() - start
                            reply += choice["token_ids"]
                    usage = event.get("usage") or usage
            details = usage.get("prompt_tokens_details") or {}
            turns.append(
                Turn(
                    user,
                    turn,
                    usage.get("prompt_tokens", len(prompt)),
                    details.get("cached_tokens", 0),
                    ttft or 0.0,
                    time.perf_counter() - start,
                )
            )
            history = prompt + reply
    return turns


def run(url: str, model: str, args) -> dict:
    rng = random.Random(7)
    system = [2] + [
        rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.system_tokens - 1)
    ]
    before = httpx.get(url + "/metrics").text
    start = time.perf_counter()
    with ThreadPoolExecutor(args.users) as pool:
        results = list(pool.map(lambda u: converse(url, model, u, system, args), range(args.users)))
    elapsed = time.perf_counter() - start
    after = httpx.get(url + "/metrics").text
    turns = [t for user in results for t in user]
    hits = metric(after, "gemma4serve:prefix_cache_hits_total") - metric(
        before, "gemma4serve:prefix_cache_hits_total"
    )
    queries = metric(after, "gemma4serve:prefix_cache_queries_total") - metric(
        before, "gemma4serve:prefix_cache_queries_total"
    )
    first = [t.ttft for t in turns if t.turn == 0]
    later = [t.ttft for t in turns if t.turn > 0]
    return {
        "seconds": elapsed,
        "turn_1_ttft_p50": percentile(first, 50),
        "turn_1_ttft_p99": percentile(first, 99),
        "later_ttft_p50": percentile(later, 50),
        "later_ttft_p99": percentile(later, 99),
        "hit_rate": hits / queries if queries else 0.0,
        "cached_share": sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns),
        "mean_prompt_tokens": statistics.mean(t.prompt_tokens for t in turns),
        "output_tokens_per_s": len(turns) * args.reply_tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--draft")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--url", help="a running server (else one is started per mode)")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=200)
    parser.add_argument("--min-token-id", type=int, default=1000, help="random prompt ids from")
    parser.add_argument("--max-token-id", type=int, default=200000, help="... up to (exclusive)")
    parser.add_argument("--modes", nargs="+", default=["on", "off"])
    parser.add_argument("--server-args", default="", help="extra server flags, one string")
    args = parser.parse_args()
    print(f"# {' '.join(sys.argv)}")
    print(
        "| prefix caching | turn 1 TTFT p50 / p99 ms | turns >= 2 TTFT p50 / p99 ms | "
        "hit rate | output tokens/s | seconds |"
    )
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        extra = args.server_args.split() + (
            ["--enable-prefix-caching"] if mode == "on" else ["--no-enable-prefix-caching"]
        )
        if args.url:
            result = run(args.url, "default", args)
        else:
            with start_server(args.model, args.draft, args.load_format, extra) as (url, model):
                result = run(url, model, args)
        print(
            f"| {mode} | {result['turn_1_ttft_p50'] * 1e3:.0f} / "
            f"{result['turn_1_ttft_p99'] * 1e3:.0f} | {result['later_ttft_p50'] * 1e3:.0f} / "
            f"{result['later_ttft_p99'] * 1e3:.0f} | {result['hit_rate']:.1%} | "
            f"{result['output_tokens_per_s']:.0f} | {result['seconds']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
