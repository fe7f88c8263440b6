#!/usr/bin/env python
"""Offline throughput of the engine, stepped directly.

Random prompts, exactly --output-len greedy tokens each. At each --concurrency level it keeps that
many requests in flight (a new one is added as soon as one finishes) and timestamps every step. Per
request: TTFT (add -> first token), TPOT (mean time per output token after the first), and ITL (the
gap between two deliveries of a request, spread over the tokens delivered together: with MTP several
tokens land at once). Next to the measured TPOT it prints the decode-step bandwidth roofline
(docs/architecture.md, "Performance model: the bandwidth roofline"): the bytes one verify step must
read (target weights, k drafter passes, KV) over the memory bandwidth, divided by the measured
tokens per step; under each row, the level's output tokens/s bounds (`output_bounds`: the prompts'
GEMMs at the matmul rate the board holds with the decode steps at that roofline, overlapped and
in waves). On CUDA each level also prints its GPU timeline: CUDA events around every launch give
the GPU's idle time before continued, scheduled-decode and prefill-carrying launches, the host's
time queueing them and the span each covers; and the GPUs' SM clock, board power and share of
time at the power cap (bench/gpu_power.py). `--sync-debug` adds the host synchronisations that torch
made implicitly during the level, by engine line (the rule: none inside a step).

    # CPU, seconds: a tiny random checkpoint
    python bench/bench_offline.py --tiny --input-len 64 --output-len 32 --concurrency 1 4 \\
        --hf-baseline
    # GPU: the real 31B shapes with random weights
    python bench/bench_offline.py --model configs/gemma-4-31B-it \\
        --draft configs/gemma-4-31B-it-assistant --load-format dummy \\
        --input-len 1000 --output-len 256 --concurrency 1 8 32 --forced-acceptance 3.1

--hf-baseline also times transformers' `generate` (concurrency 1, with and without the assistant)
on the very same weights: our modules' tensors are handed to the HF modules (their state-dict names
match), not copied.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # run from a checkout without installing

from gpu_power import PowerSampler  # noqa: E402
from request_timing import RequestTiming, mean, percentile  # noqa: E402

import gemma4serve  # noqa: E402
import gemma4serve_kernels  # noqa: E402
from gemma4serve.config import FULL, SLIDING  # noqa: E402
from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402
from gemma4serve.sampling_params import SamplingParams  # noqa: E402
from gemma4serve.structured.spec import StructuredOutputsParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        help="target checkpoint: a path, a hub id, or configs/<name> with --load-format dummy",
    )
    p.add_argument(
        "--draft", help="the MTP assistant checkpoint (omit, or --num-draft-tokens 0, for no MTP)"
    )
    p.add_argument(
        "--tiny",
        nargs="?",
        const="dense",
        metavar="VARIANT",
        help="build and use a tiny random checkpoint (dense | moe | ple; default dense) "
        "and its assistant",
    )
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--num-prompts", type=int, help="requests per level (default: 4 x concurrency, at least 8)"
    )
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument(
        "--forced-acceptance",
        type=float,
        nargs="+",
        help="benchmark mode: mean tokens per verify step (e.g. 3.1) "
        "or per-position acceptance rates",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--adaptive-draft-length", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--bandwidth-gbps", type=float, help="memory bandwidth for the roofline (default: measured)"
    )
    p.add_argument(
        "--matmul-tflops", type=float, help="matmul rate for the roofline (default: measured)"
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="skip the short warm-up run before each level"
    )
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also time transformers generate at concurrency 1",
    )
    p.add_argument(
        "--json-object",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "both"],
        help="constrain every request to a JSON object (response_format json_object); 'both' runs "
        "each level plain, then constrained, on one loaded engine: the cost of a grammar step",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer folder (configs/ hold none; --json-object needs one: "
        "bench/synthetic_tokenizer.py writes one of the full vocab size)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split over this many GPUs; parameters and the roofline are then one rank's share",
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: count the host synchronisations torch makes implicitly during each level "
        "(its sync debug mode), by the engine line that asked for them",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.tiny) or (args.tiny and args.draft):
        p.error("give --model (and optionally --draft), or --tiny")
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --input-len and --output-len must be positive")
    if args.sync_debug and not torch.cuda.is_available():
        p.error("--sync-debug needs CUDA")
    return args


# ---- measuring -----------------------------------------------------------------------------------


@dataclass
class Level:
    concurrency: int
    reqs: list[RequestTiming]
    elapsed: float
    input_tokens: int
    output_tokens: int
    accepted_len: float  # tokens per verify step, bonus included (1.0 without MTP)
    draft_share: float  # of the sequences' token-producing steps, those that verified drafts
    draft_len: int  # drafts a drafting sequence verified a step, rounded (the adaptive choice)
    slow_steps: list = field(
        default_factory=list
    )  # (seconds, what ran) of steps far above the median
    step_s: list = field(
        default_factory=list
    )  # wall time of every engine step that delivered tokens
    split: StepSplit | None = None
    timeline: str = ""  # gpu_timeline's line (CUDA only)


@dataclass
class StepSplit:
    """Where a level's engine time went: steps carrying prompt tokens against decode-only ones."""

    prefill_steps: int
    prefill_s: float
    prefill_tokens: int
    decode_steps: int
    decode_s: float
    decode_p50_ms: float

    @classmethod
    def of(cls, step_s: list[float], prefill_tokens: list[int]) -> StepSplit:
        mixed = [t for t, n in zip(step_s, prefill_tokens) if n]
        decode = [t for t, n in zip(step_s, prefill_tokens) if not n]
        return cls(
            len(mixed), sum(mixed), sum(prefill_tokens), len(decode), sum(decode),
            percentile([t * 1e3 for t in decode], 50),
        )  # fmt: skip


def run_level(
    engine: LLMEngine,
    prompts: list[list[int]],
    concurrency: int,
    output_len: int,
    tag: str,
    json_object: bool = False,
) -> Level:
    # With ignore_eos a finished grammar keeps masking (every token allowed) to the end.
    structured = StructuredOutputsParams(json_object=True) if json_object else None
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=structured
    )
    before = engine.snapshot()
    pending = list(enumerate(prompts))[::-1]
    inflight: dict[str, RequestTiming] = {}
    done: list[RequestTiming] = []
    start = time.perf_counter()
    step_times = []
    engine.runner.launch_records = []
    take_prefill_tokens(engine.runner)
    prefill_tokens = []  # prompt tokens of the steps each step() call read (0: decode only)
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            i, prompt = pending.pop()
            rid = f"{tag}-{i}"
            inflight[rid] = RequestTiming(start=time.perf_counter())
            engine.add_request(rid, prompt, params)
        t0 = time.perf_counter()
        outs = engine.step()  # returns after the step's device -> host copy: the tokens exist now
        now = time.perf_counter()
        step_times.append((now - t0, engine.runner.last_launch, bool(outs)))
        prefill_tokens.append(take_prefill_tokens(engine.runner))
        for out in outs:
            req = inflight[out.request_id]
            n = len(out.outputs[0].new_token_ids)
            if n:
                req.deliveries.append((now, n))
            if out.finished:
                assert req.output_tokens == output_len, (
                    out.request_id,
                    req.output_tokens,
                    out.outputs[0].finish_reason,
                )
                done.append(inflight.pop(out.request_id))
    elapsed = time.perf_counter() - start
    after = engine.snapshot()
    steps = after.spec_num_steps - before.spec_num_steps
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
    seq_steps = after.seq_steps - before.seq_steps
    median = sorted(t for t, _, _ in step_times)[len(step_times) // 2]
    slow = sorted(
        (x[:2] for x in step_times if x[0] > 10 * median), key=lambda x: x[0], reverse=True
    )[:3]
    return Level(
        concurrency=concurrency,
        reqs=done,
        elapsed=elapsed,
        input_tokens=sum(map(len, prompts)),
        output_tokens=len(prompts) * output_len,
        accepted_len=1.0 + accepted / steps if steps else 1.0,
        draft_share=steps / seq_steps if seq_steps else 0.0,
        draft_len=round(drafted / steps) if steps else 0,
        slow_steps=slow,
        step_s=[t for t, _, delivered in step_times if delivered],
        split=StepSplit.of([t for t, _, _ in step_times], prefill_tokens),
        timeline=gpu_timeline(engine.runner.launch_records, elapsed),
    )


ENGINE_DIRS = tuple(  # where a sync's site is looked for: the engine and its kernels
    os.path.dirname(module.__file__) + os.sep for module in (gemma4serve, gemma4serve_kernels)
)


SYNC_WARNING = "synchronizing CUDA operation"  # torch's text in its sync debug mode


@contextmanager
def implicit_syncs(sites: Counter):
    """Count, by the innermost frame of the engine or its kernels, every operation that made the
    host wait for the GPU without asking (torch's sync debug mode: `.item()`, a copy to pageable
    memory, ...). The engine's own waits for a step's outputs (CUDA events) are not counted."""

    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):  # any other warning is shown as before
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(ENGINE_DIRS)]
        where = frames[-1] if frames else traceback.FrameSummary(filename, lineno, "?")
        sites[f"{Path(where.filename).name}:{where.lineno} {where.name}"] += 1

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every one, not the first
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


# ---- the roofline --------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_step(module: torch.nn.Module, tokens: int, skip=(), cfg=None) -> float:
    """Bytes of `module`'s weights that one forward over `tokens` tokens reads.

    Tables that are only gathered from (`skip`) do not count; MoE experts count for the expected
    number of distinct experts the tokens route to (uniform routing:
    E * (1 - (1 - top_k / E) ** tokens)).
    """
    total, seen = 0.0, set()
    for name, param in module.named_parameters():
        if id(param) in seen or any(pattern in name for pattern in skip):
            continue
        seen.add(id(param))
        if cfg is not None and cfg.moe and ".experts." in name:
            E, top = cfg.num_experts, cfg.top_k_experts
            total += _nbytes(param) * (1 - (1 - top / E) ** tokens)
        else:
            total += _nbytes(param)
    return total


def kv_bytes_per_token_row(layers, elt: int) -> dict:
    """KV bytes per cached row that one pass over `layers` reads, per attention type.

    K and V of every layer count.
    """
    out = {SLIDING: 0, FULL: 0}
    for layer in layers:
        out[layer.kind] += 2 * layer.num_kv_heads * layer.head_dim * elt
    return out


@dataclass
class Roofline:
    target: float  # bytes per verify step
    draft: float  # k drafter passes
    kv: float
    bandwidth: float  # bytes / s
    decode_target: float  # bytes per 1-token step (no drafting)
    prompt_flops: float  # matmul FLOPs per prompt token that nothing reads: the producer layers'
    row_flops: float  # matmul FLOPs per read row (verified, sampled): every layer's, not the head's
    num_draft_tokens: int  # the drafts of the verify step the bytes above count

    @property
    def total(self) -> float:
        return self.target + self.draft + self.kv

    @property
    def step_s(self) -> float:
        return self.total / self.bandwidth

    @property
    def decode_s(self) -> float:
        return (self.decode_target + self.kv) / self.bandwidth


def roofline(
    engine: LLMEngine,
    concurrency: int,
    context: int,
    bandwidth: float,
    num_draft_tokens: int | None = None,
) -> Roofline:
    """The roofline of one decode step of `concurrency` sequences at `context` cached tokens.

    The step is a k+1-token verify over the target, then k drafter passes (each reading the
    target's last sliding and full layer KV); k is `num_draft_tokens` (what the adaptive draft
    length chose at this batch), else the engine's.
    """
    state = engine.state
    k = engine.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    cfg = state.target.cfg
    elt = torch.finfo(state.dtype).bits // 8
    target = weight_bytes_per_step(
        state.target, concurrency * (k + 1), skip=("embed_tokens_per_layer",), cfg=cfg
    )
    rows = {FULL: context, SLIDING: min(context, cfg.sliding_window)}
    per_row = kv_bytes_per_token_row(cfg.layers, elt)
    kv = concurrency * sum(per_row[kind] * rows[kind] for kind in rows)
    draft = 0.0
    if state.draft is not None and k:
        drafter = state.draft
        # Centroid head: only the selected clusters' rows of the table.
        if drafter.masked_embedding is not None:
            V, C = cfg.vocab_size, drafter.cfg.num_centroids
            rows_read = min(V, concurrency * drafter.cfg.centroid_top_k * V // C)
            head = rows_read * drafter.cfg.text.hidden_size * elt
            body = weight_bytes_per_step(drafter, concurrency, skip=("model.embed_tokens",))
            draft_w = body + head
        else:
            draft_w = weight_bytes_per_step(drafter, concurrency)
        d_rows = {FULL: context, SLIDING: min(context, drafter.window)}
        d_per_row = kv_bytes_per_token_row(drafter.cfg.text.layers, elt)
        d_kv = concurrency * sum(d_per_row[kind] * d_rows[kind] for kind in d_rows)
        draft = k * (draft_w + d_kv)
    decode = weight_bytes_per_step(
        state.target, concurrency, skip=("embed_tokens_per_layer",), cfg=cfg
    )
    # One multiply-add per weight a token reads (its top-k experts under MoE); attention's are
    # left out (~1% of a 1k-token prompt's on the 31B), so this bounds from above. A prompt row
    # nobody reads stops at the last layer that writes K/V, after its fused Q/K/V projection (and
    # a prompt's last row is counted as one of them).
    row = 2 * weight_bytes_per_step(state.target, 1, skip=("embed_tokens",), cfg=cfg) / elt
    last = cfg.first_shared - 1
    projection = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")
    unread = [f"layers.{i}." for i in range(last + 1, cfg.num_layers)] + [
        f"layers.{last}.{name}"
        for name, _ in state.target.layers[last].named_parameters()
        if not name.startswith(projection)
    ]
    prompt = (
        2 * weight_bytes_per_step(state.target, 1, skip=("embed_tokens", *unread), cfg=cfg) / elt
    )
    return Roofline(target, draft, kv, bandwidth, decode, prompt, row, k)


@dataclass
class OutputBounds:
    """Output tokens/s bounds of a closed loop of `concurrency` equal requests (`output_bounds`)."""

    num_draft_tokens: int  # drafts per verify step the bounds assume
    overlapped: float  # all GEMMs at the matmul rate or the decode steps' bytes, the longer
    mixed: float  # all GEMMs, then every step's KV and drafter reads, which no GEMM hides
    in_waves: float  # the prompts' GEMMs, then the decode steps' bytes


def output_bounds(
    roof: Roofline,
    concurrency: int,
    input_len: int,
    output_len: int,
    acc: float | None,
    matmul_flops: float,
) -> OutputBounds:
    """The bounds of a loop whose decode steps verify `roof.num_draft_tokens` drafts and yield
    `acc` tokens each (one without drafts). Overlapped: the prompts' and the verify rows' GEMMs
    at `matmul_flops` against the decode steps at the bandwidth roofline, whichever takes longer.
    Mixed: steps that carry prompts beside verifications read the target's weights once for both
    (hidden by the GEMMs), but their attention's KV and the drafter passes are kernels of their
    own. In waves: one after the other, as such a loop runs them (the prompts of `concurrency`
    arrivals, then their decode steps)."""
    drafting = roof.num_draft_tokens > 0 and acc is not None and acc > 1.0
    steps = output_len / acc if drafting else output_len
    rows = concurrency * (1 + roof.num_draft_tokens if drafting else 1)
    prefill_flops = concurrency * input_len * roof.prompt_flops
    gemm_s = (prefill_flops + steps * rows * roof.row_flops) / matmul_flops
    decode_s = steps * (roof.step_s if drafting else roof.decode_s)
    unhidden_s = steps * (roof.kv + (roof.draft if drafting else 0.0)) / roof.bandwidth
    tokens = concurrency * output_len
    return OutputBounds(
        num_draft_tokens=roof.num_draft_tokens if drafting else 0,
        overlapped=tokens / max(gemm_s, decode_s),
        mixed=tokens / max(gemm_s + unhidden_s, decode_s),
        in_waves=tokens / (prefill_flops / matmul_flops + decode_s),
    )


def print_output_bounds(bounds: OutputBounds) -> None:
    print(
        f"      roofline at k={bounds.num_draft_tokens}: {bounds.overlapped:.1f} out tok/s "
        f"(prompts' GEMMs and decode steps overlapped), {bounds.mixed:.1f} mixed (all GEMMs, "
        f"then each step's KV and drafter reads), {bounds.in_waves:.1f} in waves (one after the "
        "other)",
        flush=True,
    )


# Seconds a measured matmul runs: long enough for the board to reach its power cap and settle.
MATMUL_HOLD_S = 3.0


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul (cuBLAS on CUDA) held for MATMUL_HOLD_S: what prompt tokens'
    GEMMs can keep up. A burst of a few calls runs at the boost clock; held, the board reaches its
    power cap within a second and its clock drops (an H200: ~810 burst, ~680 held;
    docs/performance.md), so the rate is the one over the second half of the hold."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn_like(a)
    if device.type != "cuda":
        return 2 * n**3 / seconds_per_call(lambda: a @ b, device, reps=20)
    return 2 * n**3 * held_calls_per_second(lambda: a @ b, device)


def held_calls_per_second(fn, device: torch.device) -> float:
    """Calls per second of fn run back to back on a CUDA device for MATMUL_HOLD_S, over the second
    half of the hold, once the board's clock has settled at its power cap."""
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    calls, settled_at = 0, None
    while (now := time.perf_counter()) - start < MATMUL_HOLD_S:
        if settled_at is None and now - start >= MATMUL_HOLD_S / 2:
            calls, settled_at = 0, now
        for _ in range(10):
            fn()
        torch.cuda.synchronize(device)
        calls += 10
    return calls / (time.perf_counter() - settled_at)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    return 2 * n * 4 / seconds_per_call(lambda: b.copy_(a), device, reps=10)


def seconds_per_call(fn, device: torch.device, reps: int) -> float:
    """Wall seconds per call of fn over `reps` calls after one warm-up (3 calls on the CPU)."""
    fn()
    reps = reps if device.type == "cuda" else 3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


# ---- the transformers baseline -------------------------------------------------------------------


def to_hf(module: torch.nn.Module, cls, config, prefix: str, device: torch.device):
    """An HF model whose parameters *are* our module's tensors.

    No copy: two 31Bs would not fit on an 80 GB GPU. Built on the meta device;
    load_state_dict(assign=True) adopts our tensors. Buffers HF computes in __init__ (RoPE inverse
    frequencies, the embedding scale) are not in any state dict: rebuild those on the device.
    """
    with torch.device("meta"):
        hf = cls(config)
    state = {prefix + k: v for k, v in module.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(
            f"state dict names differ from {cls.__name__}: "
            f"missing {missing}, unexpected {unexpected}"
        )
    if "lm_head.weight" in missing:  # tied to the input embedding
        hf.lm_head.weight = hf.get_input_embeddings().weight
    for name, mod in list(hf.named_modules()):
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            with torch.device(device):
                setattr(hf.get_submodule(parent) if parent else hf, child, type(mod)(mod.config))
        elif hasattr(mod, "scalar_embed_scale"):
            mod.embed_scale = torch.tensor(mod.scalar_embed_scale, device=device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{cls.__name__}: tensors left on the meta device: {left[:5]}")
    return hf.eval()


@torch.inference_mode()
def hf_generate_timed(
    hf, prompt: list[int], n: int, assistant=None, device=None
) -> tuple[float, float, list[int]]:
    """(TTFT, TPOT, tokens) of HF greedy generate.

    TTFT comes from a 1-token run, TPOT from the n-token run.
    """
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=device)

    def gen(m):
        # No EOS: exactly m tokens, like ignore_eos (min_new_tokens would alter the logits instead).
        config = GenerationConfig(
            max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        # An explicit mask: HF would otherwise mask out every prompt token that equals the pad id.
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            assistant_model=assistant,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()

    gen(min(n, 4))  # warm-up
    t1, _ = gen(1)
    tn, tokens = gen(n)
    return t1, (tn - t1) / max(1, n - 1), tokens


def hf_baseline(
    engine: LLMEngine, prompt: list[int], output_len: int
) -> list[tuple[str, float, float, list[int]]]:
    """transformers 5.17 generate on our weights, concurrency 1, without and with the assistant.

    It consumes the engine: the KV pool is freed for HF's own cache.
    """
    import transformers
    from transformers import AutoConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    state, k = engine.state, engine.num_draft_tokens
    target_dir, draft_dir, device = state.target_dir, state.draft_dir, state.device
    target, draft = state.target, state.draft
    # Give the KV pool's memory back: HF keeps its own cache.
    engine.state = engine.runner = engine.scheduler = engine.kv = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    tcfg = AutoConfig.from_pretrained(target_dir).get_text_config()
    tcfg._attn_implementation = "sdpa"
    hf = to_hf(target, Gemma4ForCausalLM, tcfg, "model.", device)
    name = f"transformers {transformers.__version__} generate"
    rows = [(name, *hf_generate_timed(hf, prompt, output_len, device=device))]
    if draft is not None and k:
        dcfg = AutoConfig.from_pretrained(draft_dir)
        dcfg._attn_implementation = "sdpa"
        dcfg.get_text_config()._attn_implementation = "sdpa"
        hf_assistant = to_hf(draft, Gemma4AssistantForCausalLM, dcfg, "", device)
        # generate(num_assistant_tokens=...) has no effect in 5.17: the assistant's own config
        # decides, and its default schedule would adapt k; keep it fixed at ours.
        hf_assistant.generation_config.num_assistant_tokens = k
        hf_assistant.generation_config.num_assistant_tokens_schedule = "constant"
        rows.append(
            (
                f"  + assistant_model (k={k})",
                *hf_generate_timed(hf, prompt, output_len, hf_assistant, device),
            )
        )
    return rows


# ---- main ----------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({torch.get_num_threads()} threads), torch {torch.__version__}"


def build_tiny(variant: str) -> tuple[str, str]:
    from gemma4serve.demo.checkpoints import write_tiny_assistant, write_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="g4s-bench-"))
    return str(write_tiny_checkpoint(root / "target", variant)), str(
        write_tiny_assistant(root / "assistant", variant)
    )


COLUMNS = ("conc", "reqs", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
           "ITL p50", "ITL p99", "acc len", "draft %", "roof TPOT", "% roof")  # fmt: skip
WIDTHS = [max(len(c), 7) for c in COLUMNS]


def table_row(level: Level, roof: Roofline) -> str:
    def ms(xs, q):
        return percentile(xs, q) * 1e3

    ttft = [r.ttft for r in level.reqs]
    tpot = [r.tpot for r in level.reqs if r.tpot is not None]
    itl = [x for r in level.reqs for x in r.itls()]
    # A drafting step serves every sequence acc-len tokens; with an adaptive draft length, some
    # steps do not draft.
    share = level.draft_share
    roof_tpot = share * roof.step_s / level.accepted_len + (1 - share) * roof.decode_s
    total = level.input_tokens + level.output_tokens
    row = (level.concurrency, len(level.reqs),
           level.output_tokens / level.elapsed, total / level.elapsed,
           ms(ttft, 50), ms(ttft, 99), ms(tpot, 50), ms(tpot, 99), ms(itl, 50), ms(itl, 99),
           level.accepted_len, 100 * share, roof_tpot * 1e3,
           100 * roof_tpot / mean(tpot))  # fmt: skip
    return "  ".join(
        (f"{v:.2f}" if isinstance(v, float) else str(v)).rjust(w) for v, w in zip(row, WIDTHS)
    )


def greedy_tokens(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request(
        "reference", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].new_token_ids
    return tokens


def triton_cache_entries() -> set[str]:
    """The compiled Triton kernels on disk, as 'name/entry' (one entry per compiled variant)."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {
        f"{j.stem}/{j.parent.name[:8]}"
        for j in cache.glob("*/*.json")
        if not j.name.startswith("__")
    }


@dataclass
class LaunchRecord:
    """One launch call: what it queued, how long the host took to queue it, and CUDA events
    around it (on the GPU's timeline: the idle time before it and the span it covered)."""

    kind: str  # "continued" (with prompts or not), "decode" (scheduled, no prompts) or "prefill"
    host_s: float
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None


def trace_launches(runner) -> None:
    """Remember the shape of the last scheduled step, or continued step with prompts (other
    continued steps keep their predecessor's), and count the prompt tokens of the steps that the
    next `step()` call waits for (`runner.prefill_tokens`, which the reader takes with
    `take_prefill_tokens`): a scheduled step is read in the call that queues it, a continued one
    in the call after. On CUDA, record every launch in `runner.launch_records` for
    `gpu_timeline`."""
    launch, launch_continued = runner.launch, runner.launch_continued
    sample_continued = runner.sample_continued
    runner.last_launch = ""
    runner.prefill_tokens = 0  # of the steps the current step() call reads
    runner.queued_prefill_tokens = 0  # of a continued step, which the next call reads
    runner.launch_records = []
    cuda = runner.state.device.type == "cuda"

    def recorded(kind, queue, *args):
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        handle = queue(*args)
        host_s = time.perf_counter() - t0
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        runner.launch_records.append(LaunchRecord(kind, host_s, start, end))
        return handle

    def prefill_lengths(chunks) -> list[int]:
        """Lengths of the chunks that prefill (a whole-prompt cache hit computes one row)."""
        return [ch.length for ch in chunks if ch.length > 1 or not ch.samples]

    def traced_continued(previous, pages, draft_len, keep=None, prompt_chunks=()):
        prefill = prefill_lengths(prompt_chunks)
        if prefill:
            runner.last_launch = f"continued beside prefill chunks {prefill}"
        runner.queued_prefill_tokens += sum(prefill)
        kind = "continued with prompts" if prefill else "continued"
        return recorded(kind, launch_continued, previous, pages, draft_len, keep, prompt_chunks)

    def traced(chunks, draft_len):
        prefill = prefill_lengths(chunks)
        runner.last_launch = (
            f"{len(chunks)} sequences, {sum(ch.num_query for ch in chunks)} tokens, "
            f"prefill chunks {prefill}"
        )
        runner.prefill_tokens += sum(prefill)
        return recorded("prefill" if prefill else "decode", launch, chunks, draft_len)

    runner.launch = traced
    runner.launch_continued = traced_continued
    runner.sample_continued = lambda handle: recorded("continued", sample_continued, handle)


def take_prefill_tokens(runner) -> int:
    """The prompt tokens of the steps the last step() call read; the continued step it queued
    becomes the next call's."""
    taken = runner.prefill_tokens
    runner.prefill_tokens, runner.queued_prefill_tokens = runner.queued_prefill_tokens, 0
    return taken


def gpu_timeline(records: list[LaunchRecord], elapsed: float) -> str:
    """Per kind of launch: how many, the GPU's idle time before them (waiting for the host to
    queue them), the host's time queueing them, and the GPU span from its start to its end."""
    if not records or records[0].start is None:
        return ""
    records[-1].end.synchronize()
    totals: dict[str, list[float]] = {}
    for before, record in zip([None, *records], records):
        idle = before.end.elapsed_time(record.start) / 1e3 if before is not None else 0.0
        span = record.start.elapsed_time(record.end) / 1e3
        count, *sums = totals.setdefault(record.kind, [0, 0.0, 0.0, 0.0])
        totals[record.kind] = [count + 1, sums[0] + idle, sums[1] + record.host_s, sums[2] + span]
    idle_total = sum(t[1] for t in totals.values())
    parts = [
        f"{kind} {n}: idle before {idle * 1e3 / n:.2f} ms, queued in {host * 1e3 / n:.2f} ms, "
        f"span {span * 1e3 / n:.2f} ms"
        for kind, (n, idle, host, span) in sorted(totals.items())
    ]
    return (
        f"      GPU idle between launches {idle_total:.2f} s of {elapsed:.2f} s "
        f"({100 * idle_total / elapsed:.1f}%); per launch: " + "; ".join(parts)
    )


def print_level_details(level: Level, compiled: set) -> None:
    """Step-time percentiles, the prefill/decode split and the slowest steps of one level."""
    step_ms = [t * 1e3 for t in level.step_s]
    print(
        f"      engine steps that delivered tokens: {len(step_ms)}, "
        f"ms p10 {percentile(step_ms, 10):.2f} p50 {percentile(step_ms, 50):.2f} "
        f"p90 {percentile(step_ms, 90):.2f} p99 {percentile(step_ms, 99):.2f} "
        f"max {max(step_ms):.2f}",
        flush=True,
    )
    split = level.split
    prefill_rate = split.prefill_tokens / max(split.prefill_s, 1e-9)
    print(
        f"      steps with prompt tokens: {split.prefill_steps} taking {split.prefill_s:.2f} s "
        f"({split.prefill_tokens} prompt tokens, {prefill_rate:.0f}/s); "
        f"decode-only: {split.decode_steps} taking {split.decode_s:.2f} s "
        f"(p50 {split.decode_p50_ms:.2f} ms); level {level.elapsed:.2f} s",
        flush=True,
    )
    if level.timeline:
        print(level.timeline, flush=True)
    for t, what in level.slow_steps:  # tail-latency hunting: what the slowest steps ran
        print(f"      slow step {t * 1e3:.0f} ms, last launch: {what}", flush=True)
    if compiled:
        print(f"      Triton compiled during the measurement: {sorted(compiled)}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(
        "command:",
        shlex.join([sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])]),
    )
    model, draft = build_tiny(args.tiny) if args.tiny else (args.model, args.draft)
    forced = args.forced_acceptance
    if forced is not None and len(forced) == 1:
        forced = forced[0]
    k = args.num_draft_tokens if draft else 0
    batched = args.max_num_batched_tokens
    engine = LLMEngine(EngineArgs(
        model=model, draft=draft if k else None, device=args.device, dtype=args.dtype,
        load_format=args.load_format, max_model_len=args.input_len + args.output_len + 1,
        max_num_seqs=max(args.concurrency), num_draft_tokens=k,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        adaptive_draft_length=args.adaptive_draft_length, forced_acceptance=forced, seed=args.seed,
        tokenizer=args.tokenizer, tensor_parallel_size=args.tensor_parallel_size,
        detokenize=False,  # the engine as its process runs it: the server makes the text
        **({"max_num_batched_tokens": batched} if batched else {}),
    ))  # fmt: skip
    state = engine.state
    target_params = sum(p.numel() for p in state.target.parameters())
    draft_params = (
        sum(p.numel() for p in state.draft.parameters()) if state.draft is not None else 0
    )
    print("device:", device_name(state.device))
    print(f"model: {model} ({target_params / 1e9:.3f}B, {state.dtype}), "
          f"draft: {draft if k else None} ({draft_params / 1e9:.3f}B), k={k}, "
          f"forced acceptance: {forced}, weights: {args.load_format}")  # fmt: skip
    print(
        f"KV arena: {engine.kv.pool.capacity} pages, positions per page "
        f"{engine.kv.page_tokens}, max_model_len {engine.max_model_len}, "
        f"max_num_batched_tokens {engine.scheduler.max_num_batched_tokens}"
    )
    if args.bandwidth_gbps:
        bw, bw_src = args.bandwidth_gbps * 1e9, "given"
    else:
        bw, bw_src = measure_bandwidth(state.device), "measured by a device copy"
    print(f"bandwidth for the roofline: {bw / 1e9:.0f} GB/s ({bw_src})")
    if args.matmul_tflops:
        rate, rate_src = args.matmul_tflops * 1e12, "given"
    else:
        rate = measure_matmul_flops(state.device, state.dtype)
        held = f" held {MATMUL_HOLD_S:g} s" if state.device.type == "cuda" else ""
        rate_src = f"measured by a matmul{held}"
    print(f"matmul rate for the roofline: {rate / 1e12:.0f} TFLOP/s ({rate_src})")
    gpus = args.tensor_parallel_size if state.device.type == "cuda" else 0  # clock and power
    V = state.target.cfg.vocab_size
    del state  # --hf-baseline frees the engine's KV pool: keep no reference to it
    trace_launches(engine.runner)

    rng = random.Random(args.seed)
    print(
        f"\ninput {args.input_len} tokens, output {args.output_len} tokens (greedy, ignore_eos); "
        "times in ms; acc len = tokens per verify step incl. bonus; "
        "draft % = share of steps that verified drafts; "
        "roof TPOT = roofline step time / acc len"
    )
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, WIDTHS)), flush=True)
    levels = []

    def random_prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(V) for _ in range(args.input_len)] for _ in range(count)]

    for c in args.concurrency:
        n = args.num_prompts or max(8, 4 * c)
        prompts = random_prompts(n)
        warm_prompts = random_prompts(c)  # prompts of their own: measured ones would be cached
        for constrained in {"off": [False], "on": [True], "both": [False, True]}[args.json_object]:
            tag = f"c{c}" + ("-json" if constrained else "")
            # First-use costs (allocator, kernels, graphs) stay out of the numbers.
            if not args.no_warmup:
                run_level(
                    engine, warm_prompts, c, min(args.output_len, 4), f"warm-{tag}", constrained
                )
            compiled, syncs = triton_cache_entries(), Counter()
            with (
                implicit_syncs(syncs) if args.sync_debug else nullcontext(),
                PowerSampler(gpus) as power,
            ):
                level = run_level(engine, prompts, c, args.output_len, tag, constrained)
            compiled = triton_cache_entries() - compiled
            roof = roofline(engine, c, args.input_len + args.output_len // 2, bw, level.draft_len)
            levels.append((level, roof))
            if args.json_object == "both":
                print(f"      {'json_object' if constrained else 'plain'}:", flush=True)
            print(table_row(level, roof), flush=True)
            print_output_bounds(
                output_bounds(roof, c, args.input_len, args.output_len, level.accepted_len, rate)
            )
            print_level_details(level, compiled)
            if power.summary:
                print(f"      {power.summary.line()}", flush=True)
            if args.sync_debug:
                print(f"      implicit host syncs: {sum(syncs.values())}", flush=True)
                for site, count in syncs.most_common(10):
                    print(f"        {count:6d}  {site}", flush=True)

    print(
        "\ndecode-step roofline "
        "(one verify of k+1 tokens + k drafter passes, k the level's mean draft length, "
        "context input + output/2):"
    )
    for level, roof in levels:
        print(
            f"  conc {level.concurrency:>3}, k={roof.num_draft_tokens}: "
            f"{roof.total / 1e9:8.3f} GB/step = "
            f"target {roof.target / 1e9:.3f} + drafter {roof.draft / 1e9:.3f} + "
            f"KV {roof.kv / 1e9:.3f} -> {roof.step_s * 1e3:.3f} ms/step at {bw / 1e9:.0f} GB/s"
        )

    if args.hf_baseline:
        print(
            "\nbaseline at concurrency 1 "
            "(same weights, same prompt, greedy, exactly output-len tokens):"
        )
        prompt = [rng.randrange(V) for _ in range(args.input_len)]
        # Our tokens for the same prompt show that HF really runs the same weights; under forced
        # acceptance they are not the model's, so there is nothing to compare.
        ref = greedy_tokens(engine, prompt, args.output_len) if forced is None else None
        print(f"  {'':42} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8}  same tokens as ours")
        for name, ttft, tpot, tokens in hf_baseline(engine, prompt, args.output_len):
            if ref is None:
                same = "n/a (forced acceptance)"
            elif tokens == ref:
                same = "yes"
            else:
                first = next(i for i, (a, b) in enumerate(zip(tokens + [-1], ref)) if a != b)
                same = f"first {first} of {len(ref)}"
            print(f"  {name:42} {ttft * 1e3:9.2f} {tpot * 1e3:9.2f} {1 / tpot:8.1f}  {same}")
        ours = next((level for level, _ in levels if level.concurrency == 1), None)
        if ours is not None:
            ttft = percentile([r.ttft for r in ours.reqs], 50)
            tpot = mean([r.tpot for r in ours.reqs if r.tpot is not None])
            label = "gemma4serve (this run, conc 1)"
            print(f"  {label:42} {ttft * 1e3:9.2f} {tpot * 1e3:9.2f} {1 / tpot:8.1f}")
    engine.shutdown()  # tensor-parallel workers leave (nothing to do on one device)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
