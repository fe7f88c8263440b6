#!/usr/bin/env python
"""Serving throughput over HTTP, like `vllm bench serve`: the real server, streamed requests.

Random-token prompts of exactly --input-len tokens (drawn from the model's vocabulary and sent to
/v1/completions as token ids, so the length is exact with or without a tokenizer), exactly
--output-len tokens each (ignore_eos, greedy unless --temperature), streamed. At each level of
--concurrency it keeps that many requests in flight; --request-rate sends them as a Poisson process
instead (capped by the concurrency). Per level: output tokens/s, TTFT, TPOT (per request, after
the first token), ITL (the gap between two deliveries of a request, spread over the tokens
delivered together: with MTP several tokens land at once), from the server's counters the mean
queue time (arrival to first scheduled: the part of TTFT spent waiting), the mean accepted length,
the preemptions and the share of prompt tokens the prefix cache served (0 for
these random prompts: the warm-up requests have prompts of their own), and the decode-step
bandwidth roofline next to the TPOT (the bytes one step must read over the bandwidth,
docs/architecture.md; computed from the configs as bench/bench_offline.py does, so it needs
--model; its verify steps carry the mean draft length the server's counters report, the adaptive
length's choice at that load). Under each row, the level's output tokens/s bounds: the prompts' and
verify rows' GEMMs at the matmul rate (held 3 s: the board's power cap lowers it) and the decode
steps at the bandwidth, overlapped (whichever takes longer), mixed (the GEMMs, then each step's KV
and drafter reads, which steps carrying prompts still make) and in waves (one after the other, as a
closed loop of equal requests runs them); for a server it started on GPUs, their SM clock, board
power and share of time at the power cap during the level (bench/gpu_power.py); without
--request-rate, the TTFT of the level's first `concurrency` requests (sent together, so queued for
prefill at once: they set p99 over a few hundred requests) apart from the rest.

    # starts the server (bench/server_process.py), E4B shapes with dummy weights
    python bench/bench_serve.py --model configs/gemma-4-E4B-it \\
        --draft configs/gemma-4-E4B-it-assistant --load-format dummy \\
        --server-args "--forced-acceptance 3.1" --input-len 1024 --output-len 256 \\
        --concurrency 1 8 32 --result-file e4b.json
    # a server that already runs (--model, --draft only for the roofline)
    python bench/bench_serve.py --base-url http://127.0.0.1:8000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_power import PowerSampler  # noqa: E402
from request_timing import RequestTiming, mean, percentile  # noqa: E402
from server_process import start_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="target checkpoint or configs/<name> (starts the server)")
    p.add_argument("--draft", help="the MTP assistant (omit for no MTP)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--server-args", default="", help="extra server flags, one string")
    p.add_argument("--base-url", help="a running server instead of starting one")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s as a Poisson process (default inf: all at once, capped by concurrency)",
    )
    p.add_argument(
        "--num-prompts", type=int, help="requests per level (default: 4 x concurrency, at least 8)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--min-token-id", type=int, default=10, help="random prompt ids from here")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up requests per level")
    p.add_argument(
        "--bandwidth-gbps", type=float, help="memory bandwidth for the roofline (default: measured)"
    )
    p.add_argument(
        "--matmul-tflops", type=float, help="matmul rate for the roofline (default: measured)"
    )
    p.add_argument("--result-file", help="write every level's numbers here as JSON")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --result-file: each request's send time, TTFT, ITLs and error as well",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.model and not args.base_url:
        p.error("give --model (the server is started) or --base-url")
    if args.save_detailed and not args.result_file:
        p.error("--save-detailed needs --result-file")
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --input-len and --output-len must be positive")
    return args


# ---- one request ---------------------------------------------------------------------------------


async def run_request(
    http: httpx.AsyncClient, model: str, prompt: list[int], args
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "ignore_eos": True,
        "temperature": args.temperature,
        "stream": True,
        "return_token_ids": True,
    }
    result = RequestTiming(time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                count = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
                if count:
                    result.deliveries.append((time.perf_counter(), count))
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    if not result.error and result.output_tokens != args.output_len:
        result.error = f"{result.output_tokens} tokens instead of {args.output_len}"
    return result


# ---- one level -----------------------------------------------------------------------------------


COUNTERS = (  # read from /metrics before and after each level
    "spec_decode_num_drafts",  # verify steps that carried drafts
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "num_preemptions",
    "prefix_cache_hits",  # prompt tokens served from the prefix cache
    "request_queue_time_seconds_sum",  # arrival to first scheduled, summed over finished requests
    "request_queue_time_seconds_count",
    "iteration_tokens_total_sum",  # the engine's steps, by their tokens (rows)
    "iteration_tokens_total_count",
)


def server_counters(url: str) -> dict[str, float]:
    """The COUNTERS' values from /metrics (0 where the server has none)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].split(":", 1)[-1]  # any --metrics-prefix
        name = name.removesuffix("_total")
        if name in values and not line.startswith("#"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, args):
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(3600, connect=60)
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed)

    async def one(http, prompt):
        async with gate:
            return await run_request(http, model, prompt, args)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one(http, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(
    results: list[RequestTiming],
    elapsed: float,
    concurrency: int,
    counters: dict[str, float],
    prompt_tokens: int,
) -> dict:
    done = [r for r in results if r.error is None]
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    itl = [x for r in done for x in r.itls()]
    steps = counters["spec_decode_num_drafts"]
    drafted = counters["spec_decode_num_draft_tokens"]
    accepted = counters["spec_decode_num_accepted_tokens"]
    queued = counters["request_queue_time_seconds_sum"]
    num_queued = counters["request_queue_time_seconds_count"]
    num_steps = counters["iteration_tokens_total_count"]
    step_tokens = counters["iteration_tokens_total_sum"]
    summary = {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "output_tokens": sum(r.output_tokens for r in done),
        "output_throughput": sum(r.output_tokens for r in done) / elapsed,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "mean_draft_length": drafted / steps if steps else None,  # the adaptive length's choice
        "mean_queue_ms": 1e3 * queued / num_queued if num_queued else None,
        "preemptions": int(counters["num_preemptions"]),
        "prefix_cache_hit_tokens": int(counters["prefix_cache_hits"]),
        "prompt_tokens": prompt_tokens,
        "engine_steps": int(num_steps),
        "mean_step_tokens": step_tokens / num_steps if num_steps else None,
        "mean_step_ms": 1e3 * elapsed / num_steps if num_steps else None,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        summary[f"mean_{name}_ms"] = mean(values) * 1e3
        summary[f"p50_{name}_ms"] = percentile(values, 50) * 1e3
        summary[f"p99_{name}_ms"] = percentile(values, 99) * 1e3
    return summary


def first_wave(results: list[RequestTiming], concurrency: int) -> dict | None:
    """TTFT of the first `concurrency` requests, sent together, against the rest, in ms (None
    when every request is in the first wave): the first wave's prompts all queue for prefill at
    once, so at a level of a few hundred requests they alone set p99 TTFT."""
    first = [r.ttft for r in results[:concurrency] if r.error is None]
    rest = [r.ttft for r in results[concurrency:] if r.error is None]
    if not first or not rest:
        return None
    return {
        "first_wave_p50_ttft_ms": percentile(first, 50) * 1e3,
        "first_wave_max_ttft_ms": max(first) * 1e3,
        "after_first_wave_p50_ttft_ms": percentile(rest, 50) * 1e3,
        "after_first_wave_p99_ttft_ms": percentile(rest, 99) * 1e3,
    }


def per_request(results: list[RequestTiming]) -> dict:
    """Each request's times in seconds, in the order sent (vLLM's --save-detailed fields, plus
    each request's send time from the level's first): which requests set a percentile."""
    first = min(r.start for r in results)
    return {
        "start_times": [r.start - first for r in results],
        "ttfts": [r.ttft if r.deliveries else None for r in results],
        "itls": [r.itls() for r in results],
        "output_lens": [r.output_tokens for r in results],
        "errors": [r.error or "" for r in results],
    }


# ---- the roofline --------------------------------------------------------------------------------


@dataclass
class Rooflines:
    step: object  # (concurrency, context, drafts per verify step) -> bench_offline.Roofline
    bandwidth: float  # bytes / s
    bandwidth_source: str
    matmul_flops: float  # FLOP/s
    matmul_source: str


def roofline_of(args) -> Rooflines | None:
    """The rooflines over meta-device modules built from the configs, with the bandwidth and
    matmul rate (measured here unless given); None without --model."""
    if not args.model or not (Path(args.model) / "config.json").exists():
        return None
    import types

    import torch
    from bench_offline import MATMUL_HOLD_S, measure_bandwidth, measure_matmul_flops, roofline

    from gemma4serve.config import load_config
    from gemma4serve.model.assistant import Gemma4Assistant
    from gemma4serve.model.gemma4 import Gemma4Model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        target = Gemma4Model(load_config(args.model)).to(dtype)
        draft = Gemma4Assistant(load_config(args.draft)).to(dtype) if args.draft else None
    state = types.SimpleNamespace(target=target, draft=draft, dtype=dtype)
    engine = types.SimpleNamespace(state=state)  # the draft length is each level's, given
    if args.bandwidth_gbps:
        bandwidth, source = args.bandwidth_gbps * 1e9, "given"
    else:
        bandwidth, source = measure_bandwidth(device), f"measured by a {device.type} copy here"
    if args.matmul_tflops:
        flops, flops_source = args.matmul_tflops * 1e12, "given"
    else:
        flops = measure_matmul_flops(device, dtype)
        held = f" held {MATMUL_HOLD_S:g} s" if device.type == "cuda" else ""
        flops_source = f"measured by a {device.type} matmul{held} here"
    ranks = server_flag(args, ("-tp", "--tensor-parallel-size"), 1)
    if ranks > 1:  # each rank reads its 1/N of the bytes and does 1/N of the math at once
        bandwidth, source = bandwidth * ranks, f"{source}, x{ranks} tensor-parallel ranks"
        flops, flops_source = flops * ranks, f"{flops_source}, x{ranks} ranks"
    return Rooflines(
        lambda c, context, k: roofline(engine, c, context, bandwidth, k),
        bandwidth,
        source,
        flops,
        flops_source,
    )


def server_flag(args, names: tuple[str, ...], default, cast=int):
    """A flag of --server-args (`cast` from its text), or the server's default."""
    flags = args.server_args.split()
    for name in names:
        if name in flags:
            return cast(flags[flags.index(name) + 1])
    return default


COLUMNS = ("conc", "reqs", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT mean",
           "TPOT p50", "TPOT p99", "ITL mean", "ITL p50", "ITL p99", "queue", "acc len", "preempt",
           "cached %", "roof TPOT", "% roof")  # fmt: skip
WIDTHS = [max(len(c), 7) for c in COLUMNS]


def table_row(summary: dict, roof_tpot_ms: float | None) -> str:
    acc = summary["mean_accepted_length"]
    percent = 100 * roof_tpot_ms / summary["mean_tpot_ms"] if roof_tpot_ms else None
    row = [summary["concurrency"], summary["completed"], summary["output_throughput"]]
    row += [summary[f"{stat}_{name}_ms"] for name in ("ttft", "tpot", "itl")
            for stat in ("mean", "p50", "p99")]  # fmt: skip
    cached = 100 * summary["prefix_cache_hit_tokens"] / max(1, summary["prompt_tokens"])
    row += [summary["mean_queue_ms"], acc, summary["preemptions"], cached, roof_tpot_ms, percent]
    cells = ["-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v) for v in row]
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, WIDTHS))


# ---- main ----------------------------------------------------------------------------------------


def vocab_size(args) -> int:
    if args.model and (Path(args.model) / "config.json").exists():
        from gemma4serve.config import load_config

        return load_config(args.model).vocab_size
    return 256000  # every Gemma 4 vocabulary is larger: a safe range for a server we cannot see


def local_device() -> str:
    """This machine's first device: the one the server started here runs on."""
    import torch
    from bench_offline import device_name

    return device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def save(args, command: list[str], levels: list[dict]) -> None:
    """The levels so far as JSON in --result-file (after every level: a run cut short keeps
    what it measured)."""
    if args.result_file:
        config = {k: v for k, v in vars(args).items() if k != "result_file"}
        result = {"command": shlex.join(command), "args": config, "levels": levels}
        Path(args.result_file).write_text(json.dumps(result, indent=2, default=str))


def bench(url: str, model: str, args, command: list[str]) -> list[dict]:
    rng = random.Random(args.seed)
    vocab = vocab_size(args)
    roof = roofline_of(args)
    if roof is not None:
        from bench_offline import output_bounds, print_output_bounds

        rate, bandwidth = roof.matmul_flops / 1e12, roof.bandwidth / 1e9
        print(f"bandwidth for the roofline: {bandwidth:.0f} GB/s ({roof.bandwidth_source})")
        print(f"matmul rate for the roofline: {rate:.0f} TFLOP/s ({roof.matmul_source})")
    print(
        f"\ninput {args.input_len} tokens, output {args.output_len} tokens (ignore_eos, "
        f"temperature {args.temperature}), request rate {args.request_rate}; times in ms; "
        "queue = mean arrival to first scheduled, acc len = tokens per verify step incl. bonus, "
        "preempt = preemptions, cached % = prompt "
        "tokens served by the prefix cache (server metrics); "
        "roof TPOT = roofline step time / acc len"
    )
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, WIDTHS)), flush=True)
    levels = []
    # The GPUs of the server this run started (its -tp first visible ones); none behind --base-url
    # or for a server on the CPU.
    on_gpu = not args.base_url and server_flag(args, ("--device",), "cuda", str) != "cpu"
    sampled_gpus = server_flag(args, ("-tp", "--tensor-parallel-size"), 1) if on_gpu else 0

    def random_prompts(count: int) -> list[list[int]]:
        return [
            [rng.randrange(args.min_token_id, vocab) for _ in range(args.input_len)]
            for _ in range(count)
        ]

    for concurrency in args.concurrency:
        n = args.num_prompts or max(8, 4 * concurrency)
        prompts = random_prompts(n)
        if not args.no_warmup:
            # Prompts of their own: measured ones would hit the prefix cache.
            asyncio.run(run_level(url, model, random_prompts(concurrency), concurrency, args))
        before = server_counters(url)
        with PowerSampler(sampled_gpus) as power:
            results, elapsed = asyncio.run(run_level(url, model, prompts, concurrency, args))
        after = server_counters(url)
        counters = {name: after[name] - before[name] for name in COUNTERS}
        summary = summarize(results, elapsed, concurrency, counters, sum(map(len, prompts)))
        wave = first_wave(results, concurrency) if args.request_rate == float("inf") else None
        summary |= wave or {}
        roof_tpot_ms = bounds = None
        if roof is not None:
            acc, drafts = summary["mean_accepted_length"], summary["mean_draft_length"]
            context = args.input_len + args.output_len // 2
            step = roof.step(concurrency, context, round(drafts) if drafts else 0)
            roof_tpot_ms = (step.step_s / acc if acc else step.decode_s) * 1e3
            summary["roofline_step_bytes"] = step.total if acc else step.decode_target + step.kv
            bounds = output_bounds(
                step, concurrency, args.input_len, args.output_len, acc, roof.matmul_flops
            )
            summary["roofline_output_throughput"] = bounds.overlapped
            summary["roofline_mixed_output_throughput"] = bounds.mixed
            summary["roofline_in_waves_output_throughput"] = bounds.in_waves
        summary["roofline_tpot_ms"] = roof_tpot_ms
        summary["gpu_power"] = asdict(power.summary) if power.summary else None
        levels.append(summary | per_request(results) if args.save_detailed else summary)
        save(args, command, levels)
        print(table_row(summary, roof_tpot_ms), flush=True)
        if bounds is not None:
            print_output_bounds(bounds)
        if power.summary:
            print(f"      {power.summary.line()}", flush=True)
        if summary["engine_steps"]:
            print(
                f"      engine steps {summary['engine_steps']}: {summary['mean_step_tokens']:.0f} "
                f"tokens and {summary['mean_step_ms']:.2f} ms each on average (the level's time "
                "over its steps)",
                flush=True,
            )
        if wave is not None:
            print(
                f"      TTFT of the first {concurrency} requests (sent together) p50 / max "
                f"{wave['first_wave_p50_ttft_ms']:.0f} / {wave['first_wave_max_ttft_ms']:.0f} ms;"
                f" of the other {len(results) - concurrency} p50 / p99 "
                f"{wave['after_first_wave_p50_ttft_ms']:.0f} / "
                f"{wave['after_first_wave_p99_ttft_ms']:.0f} ms",
                flush=True,
            )
        if summary["failed"]:
            print(f"      {summary['failed']} failed: {summary['errors']}", flush=True)
    return levels


def main(argv=None) -> None:
    args = parse_args(argv)
    command = [sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])]
    print("command:", shlex.join(command), flush=True)
    print(f"date: {datetime.date.today()}", flush=True)
    if args.base_url:
        url = args.base_url.rstrip("/")
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        levels = bench(url, model, args, command)
    else:
        extra = args.server_args.split()
        with start_server(args.model, args.draft, args.load_format, extra) as (url, model):
            print(f"device: {local_device()}", flush=True)
            levels = bench(url, model, args, command)
    if args.result_file:
        print(f"results: {args.result_file}")
    if any(level["failed"] for level in levels):
        sys.exit(1)


if __name__ == "__main__":
    main()
