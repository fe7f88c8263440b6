"""Every attention kernel variant a rank's launches can take, compiled before it serves.

The engine's warm-up steps compile what steps of its chosen lengths launch; attention picks its
tiles and splits from more than a step's length (its groups, its longest group, a chunk's
context), so its variants are enumerated on the host instead (`kernels/attention_variants.py`).
Every rank calls this at the same point (no collectives inside).
"""

from __future__ import annotations

import logging
import time

import torch

from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.args import EngineArgs
from gemma4serve_kernels.attention_variants import (
    LaunchLimits,
    compile_variants,
    parallel_compiles,
)

log = logging.getLogger("gemma4serve")

# Threads compiling at once: as fast as 16 on the 31B's variants, and within a rank's CPU share.
_COMPILE_THREADS = 8


def launch_limits(args: EngineArgs, max_model_len: int, num_draft_tokens: int) -> LaunchLimits:
    """A step's rows (its token budget, or every sequence's verification), sequences and
    context."""
    return LaunchLimits(
        max_tokens=max(args.max_num_batched_tokens, args.max_num_seqs * (num_draft_tokens + 1)),
        max_groups=args.max_num_seqs,
        max_context=max_model_len,
    )


def compile_attention_variants(state, args: EngineArgs, num_draft_tokens: int) -> None:
    """Compile every Triton attention variant the target's and the drafter's layers can launch
    (the torch backend has none)."""
    if state.device.type != "cuda" or state.attn.name == "torch":
        return
    limits = launch_limits(args, state.kv_plan.max_model_len, num_draft_tokens)
    target = state.target.cfg
    models = [(target, {SLIDING: target.sliding_window, FULL: 0})]
    if state.draft is not None:
        models.append((state.draft.cfg.text, {SLIDING: state.draft.window, FULL: 0}))
    # (query heads, the KV store layer its kind reads, the visible window), each once: the
    # drafter's full layers are the target's site again where their heads match
    sites = dict.fromkeys(
        (cfg.num_heads, target.store_layer(kind), window)
        for cfg, windows in models
        for kind, window in windows.items()
        if kind in cfg.layer_types
    )
    site_caches = [(heads, *state.kv.layer(layer), window) for heads, layer, window in sites]
    t0 = time.monotonic()
    with parallel_compiles(workers=_COMPILE_THREADS):
        for site in site_caches:
            compile_variants(*site, limits, compile_only=True)
    launches = sum(compile_variants(*site, limits) for site in site_caches)
    torch.cuda.synchronize(state.device)
    log.info(
        "attention: %d variants of %d launch sites compiled (or loaded) in %.1fs",
        launches,
        len(sites),
        time.monotonic() - t0,
    )
