#!/usr/bin/env python
"""The scheduler alone on the serving benchmark's workload: no model, no GPU, seconds on a CPU.

The real Scheduler, KVManager and prefix cache with the server's page plan (from the configs, an
arena of --pages pages, bf16) serve `bench_serve.py`'s workload: --concurrency clients each sending
a new request of --input-len prompt tokens and --output-len output tokens (ignore_eos) when the
last one finishes. A step does to their state what the engine's does: prefill chunks advance, a
verify commits its accepted drafts (--acceptance tokens per verify step on average, bonus included)
and one token. Per level: steps, steps that carried prefill tokens, prefill tokens (prompts, and
what preempted requests computed again), preemptions, the running batch's mean, and the share of
the steps with prefill's rows that their mixed CUDA graphs add as padding (the graph of the
smallest token bucket that holds the step's rows).

    python bench/replay_scheduler.py --model configs/gemma-4-31B-it \\
        --draft configs/gemma-4-31B-it-assistant --pages 4814 --concurrency 32 64 128
    # the same reserving nothing for the outputs (as if every request stopped at once)
    python bench/replay_scheduler.py --model configs/gemma-4-31B-it \\
        --draft configs/gemma-4-31B-it-assistant --pages 4814 --concurrency 64 --no-reservation
    # the 31B's c = 32 as served: two drafts a step (the adaptive length), all accepted
    python bench/replay_scheduler.py --model configs/gemma-4-31B-it \\
        --draft configs/gemma-4-31B-it-assistant --pages 4814 --num-prompts 1000 \\
        --num-draft-tokens 2 --acceptance 3.0
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from gemma4serve.config import load_config
from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.cuda_graphs import mixed_token_buckets
from gemma4serve.engine.scheduler import Scheduler
from gemma4serve.engine.sequence import Sequence
from gemma4serve.kv.cache import KVCache, page_tokens
from gemma4serve.kv.manager import KVManager
from gemma4serve.kv.sizing import plan_kv
from gemma4serve.sampling_params import SamplingParams


def make_scheduler(args) -> Scheduler:
    """The server's scheduler over an arena of --pages pages, planned as the server plans it."""
    cfg = load_config(args.model)
    tokens = page_tokens(cfg, args.page_size)
    page_bytes = KVCache.bytes_per_page(cfg, tokens, torch.bfloat16)
    plan = plan_kv(
        cfg,
        page_size=args.page_size,
        dtype=torch.bfloat16,
        num_draft_tokens=args.num_draft_tokens,
        draft_window=load_config(args.draft).text.sliding_window if args.draft else None,
        cache_boundary_rows=math.lcm(*tokens.values()),
        kv_bytes=args.pages * page_bytes,
        kv_tokens=None,
        max_model_len=None,
    )
    scheduler = Scheduler(
        KVManager.for_plan(plan, "replay"), args.max_num_seqs, args.max_num_batched_tokens
    )
    if args.no_reservation:
        scheduler.expected_end = lambda seq: seq.num_tokens
    return scheduler


def replay(args, concurrency: int) -> dict:
    scheduler = make_scheduler(args)
    k = args.num_draft_tokens
    # Accepted drafts per verify, cycling through ten steps whose mean is acceptance - 1.
    low = math.floor(args.acceptance - 1)
    extra = round(10 * (args.acceptance - 1 - low))
    accepted = itertools.cycle([low + 1] * extra + [low] * (10 - extra))
    ids = itertools.count()
    num_requests = args.num_prompts or 4 * concurrency

    def submit():
        i = next(ids)
        prompt = [(i * 7919 + j) % 250_000 + 10 for j in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        seq = Sequence(str(i), 0, prompt, args.input_len, params, 0, i,
                       args.input_len + args.output_len)  # fmt: skip
        scheduler.add(seq)

    for _ in range(min(concurrency, num_requests)):
        submit()
    submitted, steps, mixed, prefill_tokens, running = concurrency, 0, 0, 0, 0
    buckets = mixed_token_buckets(args.max_num_batched_tokens)
    mixed_rows = padding = 0
    while scheduler.has_work():
        chunks = scheduler.schedule()
        steps += 1
        running += len(scheduler.running)
        rows = sum(chunk.num_query for chunk in chunks)  # drafts included
        step_prefill = 0
        for chunk in chunks:
            seq = chunk.seq
            if chunk.length > 1 or not chunk.samples:  # a prompt chunk, or a recomputation
                step_prefill += chunk.length
            if not chunk.samples:
                seq.num_computed += chunk.length
                continue
            taken = min(next(accepted), len(chunk.drafts))
            seq.num_computed = chunk.start + chunk.length + taken
            seq.token_ids += [5] * (taken + 1)
            seq.drafts = [6] * k
            if seq.num_tokens - seq.num_prompt >= args.output_len:
                del seq.token_ids[seq.num_prompt + args.output_len :]
                seq.num_computed = seq.num_tokens - 1
                seq.finish_reason = "length"
                scheduler.finish(seq)
                if submitted < num_requests:
                    submit()
                    submitted += 1
        prefill_tokens += step_prefill
        if step_prefill:
            mixed += 1
            mixed_rows += rows
            padding += next((t for t in buckets if t >= rows), rows) - rows  # none: eager
    return dict(
        concurrency=concurrency,
        requests=num_requests,
        steps=steps,
        mixed=mixed,
        prefill_tokens=prefill_tokens,
        preemptions=scheduler.num_preemptions,
        mean_running=running / steps,
        padded_percent=100 * padding / max(1, mixed_rows),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a folder with the target's config.json")
    p.add_argument("--draft", help="the drafter's folder (its window widens what a sequence keeps)")
    p.add_argument("--pages", type=int, required=True, help="arena pages (the server logs them)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32])
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default 4 x c)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--acceptance", type=float, default=3.1, help="tokens per verify step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    p.add_argument("--no-reservation", action="store_true", help="reserve nothing for the outputs")
    args = p.parse_args(argv)
    print(f"{'conc':>5} {'reqs':>5} {'steps':>6} {'mixed':>6} {'prefill tokens':>15} "
          f"{'preempt':>8} {'mean running':>13} {'padded %':>9}")  # fmt: skip
    for concurrency in args.concurrency:
        r = replay(args, concurrency)
        print(f"{r['concurrency']:5d} {r['requests']:5d} {r['steps']:6d} {r['mixed']:6d} "
              f"{r['prefill_tokens']:15d} {r['preemptions']:8d} {r['mean_running']:13.1f} "
              f"{r['padded_percent']:9.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
