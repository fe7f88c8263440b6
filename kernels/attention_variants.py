"""Every attention kernel variant a server's launches can take, compiled before it serves.

Triton compiles a variant of `_attn_kernel` per set of compile-time constants, which
`plan_launch` picks from a launch's host ints (its rows, groups, longest group and the context its
chunks reach); a variant first met while serving stalls that step for seconds. `reachable_launches`
walks the launch shapes within a server's limits and keeps one per distinct variant;
`compile_variants` runs each once, and every split merge the layer can take, on the real caches;
under `parallel_compiles` with `compile_only` it first queues their compiles on threads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from triton.runtime._async_compile import AsyncCompileMode

from ._common import cdiv, sm_count
from .paged_attention import (
    MAX_SPLITS,
    AttentionLayer,
    LaunchShape,
    merge_splits,
    paged_attention,
    plan_launch,
    wide_rows,
)


@dataclass(frozen=True)
class LaunchLimits:
    """What bounds a server's launches."""

    max_tokens: int  # rows of one launch (the step's token budget)
    max_groups: int  # sequences of one launch
    max_context: int  # positions one chunk reaches


def _longest_group_runs(layer: AttentionLayer, limit: int) -> list[tuple[int, int]]:
    """Runs [shortest, longest] of longest-group lengths past 8 rows (prefill chunks), up to
    `limit`, within which no tile or split choice changes: the tiles follow power-of-two buckets
    of them (a run starts one past each power of two, and at each power of two for the tiles that
    start at one), the sliding split limit steps where the window plus the chunk passes 128 keys."""
    starts = {9} | {n for j in range(4, limit.bit_length()) for n in (2**j, 2**j + 1)}
    if layer.window > 0:
        starts |= {129 - layer.window, 130 - layer.window}
    starts = sorted(n for n in starts if 9 <= n <= limit)
    return list(zip(starts, [n - 1 for n in starts[1:]] + [limit]))


def _row_counts(layer: AttentionLayer, shortest: int, limit: int) -> list[int]:
    """Rows of a prefill launch from `shortest` to `limit` that bound every run of them taking
    the same tiles: the tiles change past multiples of the wide tiles' rows (where their programs
    pass a threshold), and within a run the split depends only on its ends (the programs grow
    with the rows)."""
    step = wide_rows(layer.num_heads // layer.kv_heads)
    steps = {n for m in range(step, limit + 1, step) for n in (m, m + 1)}
    return sorted({shortest, limit} | {n for n in steps if shortest <= n <= limit})


def launch_shapes(layer: AttentionLayer, limits: LaunchLimits) -> Iterator[LaunchShape]:
    """Launch shapes covering every variant within `limits` (tests/test_triton_kernels.py checks
    them against every shape of smaller limits).

    - Decodes and verifications (at most 8 rows a group): every group count, as the split count
      (and through it the key tile and the late launch) follows it; their rows do not matter.
    - Prefill chunks: their longest group by the runs of `_longest_group_runs`, their rows by
      `_row_counts`; the most groups that hold them (beside the run's shortest longest group that
      can) and the fewest (beside its longest), as the split falls with the programs they add; no
      context and the longest (the context's tiles start at a threshold).
    """
    for q in range(1, min(8, limits.max_tokens) + 1):
        for groups in range(1, min(limits.max_groups, limits.max_tokens - q + 1) + 1):
            yield LaunchShape(groups + q - 1, groups, q)
    for shortest, longest in _longest_group_runs(layer, limits.max_tokens):
        for tokens in _row_counts(layer, shortest, limits.max_tokens):
            # the run's shortest longest group that `max_groups` groups can hold the rows beside
            narrowest, widest = max(shortest, cdiv(tokens, limits.max_groups)), min(tokens, longest)
            if narrowest > widest:
                continue
            fewest, most = cdiv(tokens, widest), min(limits.max_groups, tokens - narrowest + 1)
            for context in {0, limits.max_context}:
                yield LaunchShape(tokens, most, narrowest, context)
                yield LaunchShape(tokens, fewest, widest, context)


@functools.cache
def reachable_launches(
    layer: AttentionLayer, limits: LaunchLimits, sms: int
) -> dict[tuple, LaunchShape]:
    """One launch shape per attention variant the layer's launches within `limits` can take."""
    found: dict[tuple, LaunchShape] = {}
    for shape in launch_shapes(layer, limits):
        found.setdefault(plan_launch(layer, shape, sms).variant, shape)
    return found


def _run(shape: LaunchShape, q, k_cache, v_cache, window: int, compile_only: bool) -> None:
    """One launch of `shape` whose rows all read key 0 of page 0 (the output is dropped): its first
    group holds the longest rows, the others share the rest."""
    device = q.device
    sizes = [shape.max_q_len]
    rest, others = shape.tokens - shape.max_q_len, shape.groups - 1
    sizes += [rest // others + (i < rest % others) for i in range(others)] if others else []
    assert sum(sizes) == shape.tokens and max(sizes) == shape.max_q_len and min(sizes) >= 1
    cu_seqlens = torch.tensor([0] + sizes, device=device).cumsum(0).to(torch.int32)
    token_seq = torch.repeat_interleave(
        torch.arange(shape.groups, device=device, dtype=torch.int32),
        torch.tensor(sizes, device=device),
    )
    kv_end = torch.ones(shape.tokens, dtype=torch.int32, device=device)
    page_table = torch.zeros(shape.groups, 1, dtype=torch.int32, device=device)
    paged_attention(
        q[: shape.tokens],
        k_cache,
        v_cache,
        token_seq,
        kv_end,
        page_table,
        cu_seqlens,
        shape.max_q_len,
        window,
        chunk_context=shape.chunk_context,
        compile_only=compile_only,
    )


def compile_variants(
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window: int,
    limits: LaunchLimits,
    *,
    compile_only: bool = False,
) -> int:
    """Compile (by running once) every attention variant and split merge that launches of
    `num_heads` query heads over these caches can take within `limits` -> the launches run.
    compile_only: queue the compiles (under `parallel_compiles`) and run nothing."""
    device = k_cache.device
    _, page_size, kv_heads, head_dim = k_cache.shape
    layer = AttentionLayer(head_dim, num_heads, kv_heads, page_size, window, k_cache.dtype)
    launches = reachable_launches(layer, limits, sm_count(device))
    q = torch.zeros(limits.max_tokens, num_heads, head_dim, dtype=k_cache.dtype, device=device)
    for shape in launches.values():
        _run(shape, q, k_cache, v_cache, window, compile_only)
    out = q[:1]
    for splits in (2**j for j in range(3, MAX_SPLITS.bit_length())):
        part_o = torch.zeros(1, num_heads, splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.zeros(1, num_heads, splits, dtype=torch.float32, device=device)
        merge_splits(part_o, part_lse, out, compile_only=compile_only)
    return len(launches)


@contextlib.contextmanager
def parallel_compiles(workers: int) -> Iterator[None]:
    """Triton compiles queued inside run on `workers` threads (most of a compile waits on
    `ptxas`, outside the GIL); leaving the block waits for them all."""
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
        yield
