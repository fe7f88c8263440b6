"""The Triton kernels against the torch reference, at tiny shapes.

Without CUDA they run under the Triton interpreter (TRITON_INTERPRET=1, which must be set before
the kernels are imported); with CUDA the same tests run compiled on the GPU. The real-shape bf16
checks and CUDA graphs live in tests/gpu/.
"""

from __future__ import annotations

import importlib
import os
import threading
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from gemma4serve.attention.metadata import AttentionMetadata  # noqa: E402
from gemma4serve.attention.torch_backend import TorchAttention, write_kv  # noqa: E402
from gemma4serve.attention.triton_backend import TritonAttention  # noqa: E402
from gemma4serve.config import RopeSpec  # noqa: E402
from gemma4serve.model.layers import (  # noqa: E402
    Experts,
    Router,
    apply_rope,
    gelu_tanh,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from gemma4serve_kernels import (  # noqa: E402
    LONG_PREFIX,
    PeerBuffers,
    all_reduce_residual_norm,
    attention_config,
    first_max,
    floor_table,
    gelu_tanh_mul,
    gelu_tanh_times,
    gemv,
    gemv_mlp,
    greedy_head,
    kv_write,
    moe_align,
    moe_experts,
    moe_route,
    paged_attention,
    qkv_epilogue,
    quantize_rows,
    rmsnorm_residual_add,
    rmsnorm_rope,
    rope_tables,
    value_table,
    write_slots,
)
from gemma4serve_kernels import rms_norm as k_rms_norm  # noqa: E402
from gemma4serve_kernels._common import sm_count  # noqa: E402
from gemma4serve_kernels.attention_variants import (  # noqa: E402
    LaunchLimits,
    compile_variants,
    launch_shapes,
    reachable_launches,
)
from gemma4serve_kernels.gemv import _zeroed_scratch, mlp_down_config  # noqa: E402
from gemma4serve_kernels.paged_attention import (  # noqa: E402
    AttentionLayer,
    LaunchShape,
    plan_launch,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KIND = "attn"


# ------------------------------------------------------------------------------------- paged layout
def build_paged_batch(
    seqs, *, nh, nkv, hd, page_size, window, dtype, device=DEV, seed=0, extra_pages=3
):
    """A packed batch over a randomly paged KV pool.

    seqs: list of (cache_len, kv_ends): the sequence has K/V for positions [0, cache_len) in the
    pool, and one query row per entry of kv_ends (consecutive tokens of that sequence, one
    cu_seqlens group). Physical pages are shuffled, page-table rows are permuted against the group
    order, and logical pages wholly below the sequence's lowest visible key are reset to the null
    page 0, which is filled with NaN: any read of it, or of a key outside the window, poisons the
    output.
    """
    generator = torch.Generator().manual_seed(seed)
    B = len(seqs)
    pages_per = [-(-cache_len // page_size) for cache_len, _ in seqs]
    max_pages = max(pages_per) + 2
    num_pages = 1 + sum(pages_per) + extra_pages
    phys = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    row_of_group = torch.randperm(B, generator=generator).tolist()
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    for i, ((_, ends), n) in enumerate(zip(seqs, pages_per)):
        low = max(0, min(ends) - window) if window else 0
        for lp in range(n):
            table[row_of_group[i], lp] = phys.pop() if (lp + 1) * page_size > low else 0
    # The bulky tensors are drawn on the device.
    device_generator = torch.Generator(device).manual_seed(seed)
    k_cache = torch.randn(
        num_pages, page_size, nkv, hd, generator=device_generator, device=device
    ).to(dtype)
    v_cache = torch.randn(
        num_pages, page_size, nkv, hd, generator=device_generator, device=device
    ).to(dtype)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    token_seq, kv_end, cu = [], [], [0]
    for i, (_, ends) in enumerate(seqs):
        token_seq += [row_of_group[i]] * len(ends)
        kv_end += list(ends)
        cu.append(cu[-1] + len(ends))
    T = cu[-1]
    q = torch.randn(T, nh, hd, generator=device_generator, device=device).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        token_seq=torch.tensor(token_seq, **i32),
        kv_end=torch.tensor(kv_end, **i32),
        page_table={KIND: table.to(device)},
        write_slot={},
        window={KIND: window},
        cu_seqlens_q=torch.tensor(cu, **i32),
        max_q_len=max(len(e) for _, e in seqs),
    )
    return q, k_cache, v_cache, meta


def mixed_phases(window):
    """Every phase in one batch.

    A prefill chunk starting mid-sequence, decode, a 5-row verify, a drafter row (kv_end = committed
    length P < the rows already in the pool) and a fresh prefill from position 0.
    """
    return [
        (40, list(range(29, 41))),  # prefill chunk: positions 28..39
        (23, [23]),  # decode at position 22
        (37, list(range(33, 38))),  # verify: last token + 4 drafts, positions 32..36
        (31, [28]),  # drafter-style: rows 28..30 hold rejected drafts, invisible
        (9, list(range(1, 10))),  # first chunk of a prompt
    ]


def kernel_attention(q, k_cache, v_cache, meta, window, max_q_len=None, **overrides):
    """paged_attention over build_paged_batch's batch; `overrides`: its tuning keywords."""
    return paged_attention(
        q,
        k_cache,
        v_cache,
        meta.token_seq,
        meta.kv_end,
        meta.page_table[KIND],
        meta.cu_seqlens_q,
        max_q_len or meta.max_q_len,
        window,
        **overrides,
    )


def reference_attention(q, k_cache, v_cache, meta, dtype=None):
    if dtype is not None:
        q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    return TorchAttention().forward(q, k_cache, v_cache, meta, KIND)


# ---------------------------------------------------------------------------------------- attention
# Full attention, a window shorter than the contexts, one longer.
@pytest.mark.parametrize("window", [0, 8, 100])
@pytest.mark.parametrize("nh,nkv,hd,page_size", [(4, 2, 16, 16), (8, 1, 32, 4), (6, 2, 16, 8)])
def test_attention_mixed_phases_fp32(window, nh, nkv, hd, page_size):
    q, kc, vc, meta = build_paged_batch(
        mixed_phases(window),
        nh=nh,
        nkv=nkv,
        hd=hd,
        page_size=page_size,
        window=window,
        dtype=torch.float32,
        seed=window + hd,
    )
    ref = reference_attention(q, kc, vc, meta)
    out = TritonAttention().forward(q, kc, vc, meta, KIND)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("table_entries", [32, 4])
@pytest.mark.parametrize("num_splits,block_t", [(1, 1), (3, 1), (8, 4)])
def test_attention_splits_and_query_blocks(num_splits, block_t, table_entries, monkeypatch):
    """Small key tiles, so that contexts span many tiles, with split KV ranges and query rows.

    The KV range is split over 3/8 programs (some empty) and the query rows of a group over several
    programs. With 4 table entries held, a program reads its pages in chunks of one tile. The
    splits' partial buffers start as NaN: what an empty split leaves unwritten must not reach the
    output.
    """
    monkeypatch.setattr(
        importlib.import_module("gemma4serve_kernels.paged_attention"), "TABLE_CHUNK", table_entries
    )
    window = 12
    q, kc, vc, meta = build_paged_batch(
        mixed_phases(window),
        nh=4,
        nkv=2,
        hd=16,
        page_size=4,
        window=window,
        dtype=torch.float32,
        seed=7,
    )
    ref = reference_attention(q, kc, vc, meta)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    out = kernel_attention(
        q,
        kc,
        vc,
        meta,
        window,
        num_splits=num_splits,
        min_split_keys=1,
        config=dict(block_t=block_t, block_m=16, block_n=16),
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_sliding_verification_splits_keep_the_grid_within_one_and_a_half_waves():
    """The E4B's sliding layers (2 KV heads, at most 5 splits of its 514 keys) on 132 SMs: batch 32
    gets 3 splits (192 programs; 5 made 320, two and a half waves), smaller batches the most, and
    a batch whose grid already fills the GPU none."""
    splits = importlib.import_module("gemma4serve_kernels.paged_attention").splits_within_waves
    assert [splits(batch * 2, 132, 5) for batch in (1, 8, 16, 32, 64, 128)] == [5, 5, 5, 3, 1, 1]


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("block_t", [4, 16])
def test_attention_prefill_tiles_seen_whole(window, block_t):
    """Long chunks run the prefill key loop: key tiles that every row of a query block sees whole
    skip the score mask, the tiles on the causal diagonal and the window's edge keep it."""
    q, kc, vc, meta = build_paged_batch(
        [(130, list(range(61, 131))), (23, [23]), (50, list(range(1, 41)))],
        nh=4,
        nkv=2,
        hd=16,
        page_size=4,
        window=window,
        dtype=torch.float32,
        seed=11 + window,
    )
    ref = reference_attention(q, kc, vc, meta)
    out = kernel_attention(
        q,
        kc,
        vc,
        meta,
        window,
        config=dict(block_t=block_t, block_n=16),
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_attention_prefill_flat_grid_many_groups():
    """Prefill chunks number their query blocks in one flat axis: a long chunk beside 150 short
    groups (more than one 128-group pass of the block-to-group search), groups whose rows do not
    start at a block boundary, and empty groups after the last (as a mixed graph's padding leaves
    them). Every row must come from its own group's program: the output starts as NaN."""
    seqs = [(90, list(range(31, 91)))] + [(9 + i % 7, [9 + i % 7]) for i in range(150)]
    seqs += [(40, list(range(28, 41)))]
    q, kc, vc, meta = build_paged_batch(
        seqs, nh=2, nkv=1, hd=16, page_size=4, window=0, dtype=torch.float32, seed=5
    )
    ref = reference_attention(q, kc, vc, meta)
    T = q.shape[0]
    meta.cu_seqlens_q = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q.new_full((3,), T)])
    out = torch.full_like(q, float("nan"))
    kernel_attention(q, kc, vc, meta, 0, out=out, config=dict(block_t=16, block_n=16))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "tiles",
    [{}, dict(block_t=16), dict(short_block_t=16), dict(value_parts=2), dict(value_parts=4)],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_short_groups_beside_a_prompt_chunk(num_splits, tiles, monkeypatch):
    """In a prefill launch, groups of at most the short tiles' tokens (8 here: 16 rows of a
    2-head group) run the few-row key loop, longer ones the chunk's: groups of 1, 9, 1 and 8 rows
    before a chunk, then empty groups as a mixed graph pads them. With 16-token query blocks the
    8 rows cross a block's edge; 16-token short tiles (their rows sized to fit) take the 9 too.
    The chunks' value columns may be split over programs (the short groups' are not).
    Splits' partials start as NaN, the page table is read in chunks of 4 entries, and the output
    starts as NaN: every row and column is written."""
    module = importlib.import_module("gemma4serve_kernels.paged_attention")
    monkeypatch.setattr(module, "TABLE_CHUNK", 4)
    seqs = [(23, [23]), (44, list(range(36, 45))), (5, [5]), (37, list(range(30, 38)))]
    seqs += [(70, list(range(31, 71)))]
    q, kc, vc, meta = build_paged_batch(
        seqs, nh=4, nkv=2, hd=16, page_size=4, window=20, dtype=torch.float32, seed=13
    )
    ref = reference_attention(q, kc, vc, meta)
    meta.cu_seqlens_q = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q.new_full((2,), q.shape[0])])
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    out = torch.full_like(q, float("nan"))
    config = dict(block_n=16, short_block_n=8) | tiles
    kernel_attention(
        q, kc, vc, meta, 20, out=out, num_splits=num_splits, min_split_keys=1, config=config
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_prefill_takes_128_row_tiles_only_with_programs_for_them():
    """The 31B's shapes: sliding layers (16 KV heads of 2 query heads, 256 wide) from 1024 rows,
    full layers (4 KV heads of 8, 512 wide) from 2048 with their value columns split; the
    26B-A4B's full layers (2 KV heads) not at 2048; decode and verification never."""
    assert attention_config(256, 2, 1024, tokens=1024, kv_heads=16)["block_m"] == 128
    assert attention_config(256, 2, 512, tokens=512, kv_heads=16)["block_m"] == 64
    wide = attention_config(512, 8, 2048, tokens=2048, kv_heads=4)
    assert (wide["block_m"], wide["value_parts"]) == (128, 2)
    assert attention_config(512, 8, 1024, tokens=1024, kv_heads=4)["value_parts"] == 1
    assert attention_config(512, 8, 2048, tokens=2048, kv_heads=2)["value_parts"] == 1
    assert attention_config(512, 8, 3, tokens=4096, kv_heads=4)["value_parts"] == 1


def test_full_layers_take_128_row_tiles_over_a_long_prefix():
    """Launches of 1024 rows and more whose chunks reach 8192 positions: the full layers take the
    split 128-row tiles with fewer programs than alone (the 26B-A4B's 2 KV heads, the E4B's 4
    query heads to a KV head); 4096 positions, fewer rows, the sliding layers and verification
    keep their tiles."""

    def tiles(head_dim, group, rows, tokens, kv_heads, context):
        cfg = attention_config(head_dim, group, rows, tokens, kv_heads, context)
        return cfg["block_m"], cfg["value_parts"]

    assert tiles(512, 8, 2048, 2048, 2, 8192) == (128, 2)
    assert tiles(512, 4, 1024, 1024, 2, 32768) == (128, 2)  # the E4B's
    assert tiles(512, 8, 2048, 2048, 2, 4096)[1] == 1
    assert tiles(512, 8, 512, 512, 4, 32768)[1] == 1
    assert tiles(256, 2, 1024, 1024, 8, 32768)[0] == 64
    assert tiles(512, 8, 3, 4096, 4, 32768)[1] == 1  # verification


def _every_variant(layer, limits, sms: int) -> set:
    """The attention variants of every launch shape within `limits`: each row count, longest
    group, group count (from the fewest that hold the rows) and context a launch can have."""
    found = set()
    for tokens in range(1, limits.max_tokens + 1):
        for q in range(1, tokens + 1):
            for groups in range(-(-tokens // q), min(limits.max_groups, tokens - q + 1) + 1):
                for context in (0, limits.max_context):
                    shape = LaunchShape(tokens, groups, q, context)
                    found.add(plan_launch(layer, shape, sms).variant)
    return found


@pytest.mark.parametrize(
    "layer, sms, wide_programs",
    [
        (AttentionLayer(256, 4, 2, 16, 1024), 4, 4),  # sliding, 2 query heads a KV head
        (AttentionLayer(512, 16, 2, 16, 0), 16, 4),  # full, 8 a KV head, value columns split
        (AttentionLayer(16, 4, 2, 4, 20), 4, 4),  # a window short enough to stop the splits
        # a lone chunk between two powers of two splits where two groups would not (a review's
        # case: the 31B's 961-1023-row chunks, 1985-2047 on a rank of two)
        (AttentionLayer(256, 16, 2, 16, 1024), 7, 12),
    ],
)
def test_the_enumerated_launches_meet_every_attention_variant(
    layer, sms, wide_programs, monkeypatch
):
    """`reachable_launches` finds every variant any launch within the limits takes, and no other:
    against every launch shape, with the thresholds of the wide and long-prefix tiles brought
    within 144 rows so that the walk passes them."""
    module = importlib.import_module("gemma4serve_kernels.paged_attention")
    monkeypatch.setattr(module, "WIDE_TILE_PROGRAMS", {1: wide_programs, 2: 8})
    monkeypatch.setattr(module, "LONG_PREFIX_TOKENS", 48)
    limits = LaunchLimits(max_tokens=144, max_groups=12, max_context=LONG_PREFIX)
    for shape in launch_shapes(layer, limits):  # each a launch the server can make
        assert shape.groups <= limits.max_groups
        assert shape.groups * shape.max_q_len >= shape.tokens >= shape.groups - 1 + shape.max_q_len
    found = reachable_launches.__wrapped__(layer, limits, sms)
    assert set(found) == _every_variant(layer, limits, sms)
    assert {plan_launch(layer, shape, sms).variant for shape in found.values()} == set(found)


def test_compile_variants_launches_each_enumerated_variant(monkeypatch):
    """`compile_variants` builds, for each enumerated launch shape, metadata whose launch plans the
    same variant, and runs it (here under the interpreter); then every split merge."""
    module = importlib.import_module("gemma4serve_kernels.paged_attention")
    plan, planned = module.plan_launch, set()

    def recorded(*args, **kwargs):
        launch = plan(*args, **kwargs)
        planned.add(launch.variant)
        return launch

    monkeypatch.setattr(module, "plan_launch", recorded)
    cache = torch.zeros(4, 4, 2, 16)
    limits = LaunchLimits(max_tokens=24, max_groups=4, max_context=64)
    launches = compile_variants(4, cache, cache, 20, limits)
    layer = AttentionLayer(16, 4, 2, 4, 20, torch.float32)
    assert planned == set(reachable_launches(layer, limits, sm_count(cache.device)))
    assert launches == len(planned) > 4


def test_attention_grid_within_cuda_limits_for_a_huge_step(monkeypatch):
    """A step of 600,000 prompt tokens (a large --max-num-batched-tokens) on 8-head groups is
    75,000 query blocks: past CUDA's 65,535 on a grid's second and third axes, so they go on the
    first. The launch is recorded, not run."""
    module = importlib.import_module("gemma4serve_kernels.paged_attention")
    grids = []

    class Recorder:
        def run(self, *args, grid, warmup, **kwargs):
            grids.append(grid)

    monkeypatch.setattr(module, "_attn_kernel", Recorder())
    T, nh, nkv, hd = 600_000, 8, 1, 16
    q = torch.zeros(1, nh, hd).expand(T, nh, hd)  # one row's storage, seen T times
    cache = torch.zeros(4, 16, nkv, hd)
    i32 = dict(dtype=torch.int32)
    paged_attention(
        q,
        cache,
        cache,
        torch.zeros(T, **i32),
        torch.zeros(1, **i32).expand(T),
        torch.zeros(1, 4, **i32),
        torch.tensor([0, T], **i32),
        T,
        0,
        out=q,
        num_splits=1,
    )
    (grid,) = grids
    assert grid[0] < 2**31 and all(axis <= 65535 for axis in grid[1:])


def test_attention_drafter_batch():
    """The drafter's reads: one row per sequence at kv_end = P, window W_a + 1.

    Stale rows beyond P stay in the pool.
    """
    W_a = 6
    seqs = [(30, [25]), (12, [12]), (7, [5]), (50, [47])]
    q, kc, vc, meta = build_paged_batch(
        seqs, nh=8, nkv=2, hd=32, page_size=4, window=W_a + 1, dtype=torch.float32, seed=3
    )
    ref = reference_attention(q, kc, vc, meta)
    out = kernel_attention(
        q,
        kc,
        vc,
        meta,
        W_a + 1,
        max_q_len=1,
        num_splits=2,
        min_split_keys=1,
        config=dict(block_n=16),
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half_precision(dtype):
    window = 8
    q, kc, vc, meta = build_paged_batch(
        mixed_phases(window), nh=4, nkv=2, hd=32, page_size=16, window=window, dtype=dtype, seed=11
    )
    ref32 = reference_attention(q, kc, vc, meta, torch.float32)
    out = kernel_attention(
        q,
        kc,
        vc,
        meta,
        window,
        num_splits=2,
        min_split_keys=1,
        config=dict(block_n=16),
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=2e-2)


def test_attention_empty_view_is_zero():
    """A row that sees no key (kv_end 0; never scheduled in practice) gives zeros rather than NaN.

    It does not disturb the other rows.
    """
    q, kc, vc, meta = build_paged_batch(
        [(4, [0]), (4, [3])], nh=2, nkv=1, hd=16, page_size=4, window=0, dtype=torch.float32
    )
    out = TritonAttention().forward(q, kc, vc, meta, KIND)
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(
        out[1], reference_attention(q, kc, vc, meta)[1], atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write(dtype):
    generator = torch.Generator().manual_seed(0)
    num_pages, page_size, nkv, hd, T = 6, 4, 2, 16, 7
    k_cache = torch.randn(num_pages, page_size, nkv, hd, generator=generator).to(dtype).to(DEV)
    v_cache = torch.randn(num_pages, page_size, nkv, hd, generator=generator).to(dtype).to(DEV)
    k = torch.randn(T, nkv, hd, generator=generator).to(dtype).to(DEV)
    v = torch.randn(T, nkv, hd, generator=generator).to(dtype).to(DEV)
    slots = torch.tensor([5, 17, -1, 4, 23, -1, 9], dtype=torch.int64, device=DEV)
    kr, vr = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv(kr, vr, k[keep], v[keep], slots[keep])
    kv_write(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)


def _torch_rope(inv: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
    emb = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables(dtype):
    """One launch = the torch ops' tables.

    Proportional RoPE: the pass-through pairs give cos 1, sin 0. Here np.cos is compared with
    torch's CPU cos, so within an ulp of fp32 / bf16 (tests/gpu checks the CUDA path bit for bit).
    """
    pos = torch.tensor([0, 1, 7, 15, 16, 300, 1000, 131071], dtype=torch.int64)
    for hd, pairs in ((16, 8), (32, 4)):
        inv = rope_inv_freq(RopeSpec(theta=1e4, head_dim=hd, rotated_pairs=pairs))
        cos, sin = rope_tables(inv.to(DEV), pos.to(DEV), dtype)
        ref_cos, ref_sin = _torch_rope(inv, pos, dtype)
        tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2**-8)
        torch.testing.assert_close(cos.cpu(), ref_cos, **tol)
        torch.testing.assert_close(sin.cpu(), ref_sin, **tol)
        assert torch.equal(
            cos[:, pairs : hd // 2].cpu(), torch.ones(len(pos), hd // 2 - pairs, dtype=dtype)
        )


def test_write_slots():
    """kv_end = pos + 1 and each token's slot through its row of both page tables, as the torch ops,
    with each table's own positions per page.

    Padding rows on the null-page row write slots of page 0.
    """
    page_tokens = {"full": 8, "sliding": 4}
    tables = {
        "full": torch.tensor([[3, 5, 8], [2, 0, 0], [0, 0, 0]], dtype=torch.int32),
        "sliding": torch.tensor([[1, 4, 6], [7, 0, 0], [0, 0, 0]], dtype=torch.int32),
    }
    token_seq = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    pos = torch.tensor([5, 9, 2, 0], dtype=torch.int64)
    kv_end, slots = write_slots(
        token_seq.to(DEV), pos.to(DEV), {k: t.to(DEV) for k, t in tables.items()}, page_tokens
    )
    assert kv_end.tolist() == [6, 10, 3, 1] and kv_end.dtype == torch.int32
    assert (
        slots["full"].tolist() == [3 * 8 + 5, 5 * 8 + 1, 2 * 8 + 2, 0]
        and slots["full"].dtype == torch.int64
    )
    assert slots["sliding"].tolist() == [4 * 4 + 1, 6 * 4 + 1, 7 * 4 + 2, 0]


# -------------------------------------------------------------------------------------- norms / act
def on_cpu(fn, *args):
    """Run a torch reference on CPU copies of its tensor arguments and bring the result back to DEV.

    On CUDA, layers.py itself dispatches to these kernels (gemma4serve/model/fused.py), so a
    reference computed on the GPU would compare a kernel with itself; on CPU the reference ops
    always run.
    """
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        out = fn(*cpu)
    if isinstance(out, tuple):
        return tuple(o.to(DEV) for o in out)
    return out.to(DEV)


def _assert_rounding_close(out, ref):
    """Assert the same rounding points as the reference.

    Only fp32 reduction order and transcendental ulps differ, so at most a rare 1-ulp flip of the
    model dtype (ignoring values that are ~0, e.g. the GELU's negative tail where the tanh formula
    cancels in both implementations).
    """
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    ulp = 2.0**-7 if ref.dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=ulp)
    significant = ref.float().abs() > 1e-3
    assert (out != ref)[significant].float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(dtype, with_weight):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 3, 40, generator=generator) * 3).to(dtype).to(DEV)
    w = (torch.rand(40, generator=generator) * 2).to(dtype).to(DEV) if with_weight else None
    _assert_rounding_close(k_rms_norm(x, w, 1e-6), on_cpu(rms_norm, x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_of_strided_head_views(dtype):
    """Per-head views into a fused q|k|v projection output ([T, heads, hd], wide token stride)."""
    generator = torch.Generator().manual_seed(9)
    T, hd = 4, 32
    fused = (torch.randn(T, 7 * hd, generator=generator) * 3).to(dtype).to(DEV)
    k_view = fused[:, 4 * hd : 6 * hd].view(T, 2, hd)
    v_view = fused[:, 5 * hd : 7 * hd].view(T, 2, hd)
    w = (torch.rand(hd, generator=generator) * 2).to(dtype).to(DEV)
    _assert_rounding_close(k_rms_norm(v_view, None, 1e-6), on_cpu(rms_norm, v_view, None, 1e-6))
    inv = rope_inv_freq(RopeSpec(theta=1e4, head_dim=hd, rotated_pairs=hd // 2))
    cos, sin = (c.to(DEV) for c in rope_cos_sin(inv, torch.arange(T) * 5, dtype))
    _assert_rounding_close(
        rmsnorm_rope(k_view, w, cos, sin, 1e-6), on_cpu(_norm_rope_ref, k_view, w, cos, sin)
    )


def _residual_ref(x, h, w, scalar):
    out = x + rms_norm(h, w, 1e-6)
    return out if scalar is None else out * scalar


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scalar", [False, True])
def test_rmsnorm_residual_add(dtype, with_scalar):
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 48, generator=generator) * 4).to(dtype).to(DEV)
    h = (torch.randn(6, 48, generator=generator) * 9).to(dtype).to(DEV)
    w = (torch.rand(48, generator=generator) * 2).to(dtype).to(DEV)
    scalar = torch.tensor([0.37], dtype=dtype, device=DEV) if with_scalar else None
    _assert_rounding_close(
        rmsnorm_residual_add(x, h, w, 1e-6, scalar), on_cpu(_residual_ref, x, h, w, scalar)
    )


def rank_1_of_2(source_packets: int, epoch: int, programs: int):
    """Both ranks' receive buffers (zeroed) and rank 1's PeerBuffers over them: the test plays
    rank 0."""
    buffers = [torch.zeros(4 * source_packets, dtype=torch.int64, device=DEV) for _ in range(2)]
    peers = PeerBuffers(
        rank=1,
        world=2,
        buffers=torch.tensor([b.data_ptr() for b in buffers], device=DEV),
        epoch=torch.tensor([epoch, 0], device=DEV),
        source_packets=source_packets,
        max_programs=programs,
    )
    return buffers, peers


@pytest.mark.parametrize("with_scalar,with_next", [(False, True), (True, False)])
def test_all_reduce_residual_norm_as_one_rank_of_two(with_scalar, with_next):
    """Rank 1 of two, its peer played by a thread of the test: rank 0's packets land while the
    kernel waits, over zeros or a stale epoch's packets. Three calls (both buffer parities), more
    rows than programs."""
    world, rank, source_packets = 2, 1, 7 * 24
    buffers, peers = rank_1_of_2(source_packets, epoch=1, programs=3)
    generator = torch.Generator().manual_seed(4)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).bfloat16().to(DEV)

    def packets(rows, epoch):  # two bf16 in the low half, the epoch in the high half
        return (rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | epoch << 32

    for epoch in (1, 2, 3):
        parity, rows = epoch & 1, 7 - epoch
        x, mine, theirs = rand(rows, 48, scale=4), rand(rows, 48, scale=9), rand(rows, 48, scale=9)
        w, w2 = rand(48), rand(48)
        scalar = torch.tensor([0.37], dtype=torch.bfloat16, device=DEV) if with_scalar else None
        peer_region = (parity * world + 0) * source_packets

        def send():  # the peer's packets arrive while the kernel waits on the old ones
            time.sleep(0.05)
            buffers[rank][peer_region : peer_region + rows * 24] = packets(theirs, epoch).flatten()

        peer = threading.Thread(target=send)
        peer.start()
        y, z = all_reduce_residual_norm(x, mine, w, 1e-6, scalar, w2 if with_next else None, peers)
        peer.join()
        ry, rz = rmsnorm_residual_add(x, theirs + mine, w, 1e-6, scalar, w2)
        assert torch.equal(y, ry)
        assert torch.equal(z, rz) if with_next else z is None
        # This rank's packets reached the peer, and the epoch moved on.
        my_region = (parity * world + rank) * source_packets
        sent = buffers[0][my_region : my_region + rows * 24].view(rows, 24)
        assert torch.equal(sent, packets(mine, epoch))
        assert peers.epoch.tolist() == [epoch + 1, 0]


@pytest.mark.parametrize("split", [1, 2])
def test_gemv_sends_its_rows_as_the_fused_all_reduces_packets(split):
    """Rank 1 of two: a row-parallel GEMV with `push` stores its output and sends it to the peer
    as the next fused all-reduce's packets (one K split, or two summed by the last); the
    all-reduce told so sends nothing itself and sums its rows with the peer's."""
    world, rank, source_packets, epoch = 2, 1, 4 * 24, 3
    buffers, peers = rank_1_of_2(source_packets, epoch, programs=2)
    generator = torch.Generator().manual_seed(5)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).bfloat16().to(DEV)

    def packets(rows):
        return (rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | epoch << 32

    rows, parity = 3, epoch & 1
    x, w = rand(rows, 64), rand(48, 64, scale=0.2)
    h = gemv(x, w, config=(16, 32, 1, 1, split), push=peers)
    if torch.cuda.is_available():  # the interpreter's plain store truncates; pushed rows round
        assert torch.equal(h, gemv(x, w, config=(16, 32, 1, 1, split)))
    ref = x.double() @ w.double().T
    assert ((h.double() - ref).norm() / ref.norm()).item() < 1e-2
    region = (parity * world + rank) * source_packets
    sent = buffers[0][region : region + rows * 24]
    assert torch.equal(sent.view(rows, 24), packets(h))
    assert not buffers[0][:region].any() and not buffers[0][region + rows * 24 :].any()
    assert not buffers[1].any() and peers.epoch.tolist() == [epoch, 0]  # the all-reduce's to move

    buffers[0].zero_()
    theirs, residual, weight = rand(rows, 48, scale=9), rand(rows, 48, scale=4), rand(48)
    peer_region = (parity * world + 0) * source_packets
    buffers[rank][peer_region : peer_region + rows * 24] = packets(theirs).flatten()
    y, _ = all_reduce_residual_norm(residual, h, weight, 1e-6, None, None, peers, pushed=True)
    assert torch.equal(y, rmsnorm_residual_add(residual, theirs + h, weight, 1e-6))
    assert not buffers[0].any()  # it sent nothing
    assert peers.epoch.tolist() == [epoch + 1, 0]


def _norm_rope_ref(x, w, cos, sin):
    return apply_rope(rms_norm(x, w, 1e-6), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Default and proportional RoPE.
@pytest.mark.parametrize("hd,rotated_pairs,theta", [(32, 16, 1e4), (32, 4, 1e6)])
def test_rmsnorm_rope(dtype, hd, rotated_pairs, theta):
    generator = torch.Generator().manual_seed(3)
    T, heads = 5, 3
    x = (torch.randn(T, heads, hd, generator=generator) * 2).to(dtype).to(DEV)
    w = (torch.rand(hd, generator=generator) * 2).to(dtype).to(DEV)
    inv = rope_inv_freq(RopeSpec(theta=theta, head_dim=hd, rotated_pairs=rotated_pairs))
    cos, sin = rope_cos_sin(inv, torch.tensor([0, 3, 17, 250, 4097]), dtype)
    cos, sin = cos.to(DEV), sin.to(DEV)
    _assert_rounding_close(
        rmsnorm_rope(x, w, cos, sin, 1e-6), on_cpu(_norm_rope_ref, x, w, cos, sin)
    )


def _qkv_epilogue_ref(qkv, qw, kw, cos, sin, k_cache, v_cache, slots, nh, nkv, k_eq_v):
    T, hd = qkv.shape[0], k_cache.shape[-1]
    q, k = qkv[:, : nh * hd].view(T, nh, hd), qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)
    v = k if k_eq_v else qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
    keep = slots >= 0
    kc, vc = k_cache.clone(), v_cache.clone()
    write_kv(
        kc, vc, _norm_rope_ref(k, kw, cos, sin)[keep], rms_norm(v, None, 1e-6)[keep], slots[keep]
    )
    return _norm_rope_ref(q, qw, cos, sin), kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize("heads_per_program", [None, 2, 4])
def test_qkv_epilogue(dtype, k_eq_v, heads_per_program):
    """q/k norms + RoPE, v_norm and the K/V write in one launch equal the separate reference ops,
    with one query head per program (decode) or several (prefill chunks)."""
    generator = torch.Generator().manual_seed(5)
    T, nh, nkv, hd, pages, page_size = 5, 4, 2, 32, 4, 4
    width = (nh + nkv * (1 if k_eq_v else 2)) * hd
    qkv = (torch.randn(T, width, generator=generator) * 2).to(dtype).to(DEV)
    qw, kw = ((torch.rand(hd, generator=generator) * 2).to(dtype).to(DEV) for _ in range(2))
    cos, sin = (
        t.to(DEV)
        for t in rope_cos_sin(
            rope_inv_freq(RopeSpec(1e6, hd, 4)), torch.tensor([0, 3, 9, 40, 77]), dtype
        )
    )
    k_cache = torch.randn(pages, page_size, nkv, hd, generator=generator).to(dtype).to(DEV)
    v_cache = torch.randn(pages, page_size, nkv, hd, generator=generator).to(dtype).to(DEV)
    slots = torch.tensor([5, 6, -1, 12, 0], dtype=torch.int64, device=DEV)
    ref_q, ref_k, ref_v = on_cpu(
        _qkv_epilogue_ref, qkv, qw, kw, cos, sin, k_cache, v_cache, slots, nh, nkv, k_eq_v
    )
    q = qkv_epilogue(
        qkv, qw, kw, cos, sin, 1e-6, k_cache, v_cache, slots, nh, nkv, k_eq_v, heads_per_program
    )
    _assert_rounding_close(q, ref_q)
    _assert_rounding_close(k_cache, ref_k)
    _assert_rounding_close(v_cache, ref_v)


def _gelu_mul_ref(gu):
    gate, up = gu.chunk(2, dim=-1)
    return gelu_tanh(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(dtype):
    generator = torch.Generator().manual_seed(4)
    gu = (torch.randn(7, 2 * 24, generator=generator) * 3).to(dtype).to(DEV)
    _assert_rounding_close(gelu_tanh_mul(gu), on_cpu(_gelu_mul_ref, gu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_times(dtype):
    """PLE's gate: gelu_tanh(gate) * up from two tensors, up a strided slice of a wider tensor."""
    generator = torch.Generator().manual_seed(5)
    gate = (torch.randn(6, 40, generator=generator) * 3).to(dtype).to(DEV)
    up = torch.randn(6, 3, 40, generator=generator).to(dtype).to(DEV)[:, 1]
    _assert_rounding_close(
        gelu_tanh_times(gate, up), on_cpu(lambda g, u: gelu_tanh(g) * u, gate, up)
    )


# -------------------------------------------------------------------------------------- skinny GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 300), (5, 256), (16, 300)])
def test_gemv_matches_linear(dtype, M, K):
    """Ragged N, K ragged (300) or a multiple of the tiles (256), and a strided input view.

    The input is part of a wider row.
    """
    generator = torch.Generator().manual_seed(6)
    N = 70
    wide = torch.randn(M, K + 40, generator=generator).to(dtype).to(DEV)
    x = wide[:, 8 : 8 + K]
    w = torch.randn(N, K, generator=generator).to(dtype).to(DEV)
    ref = x.double() @ w.double().T
    # (BN, BK, warps, stages, K splits); 8 splits of K 300 become 5 of one 64-wide tile each
    for cfg in (None, (16, 64, 4, 2, 1), (32, 128, 4, 3, 1), (16, 64, 4, 2, 3), (32, 64, 4, 2, 8)):
        y = gemv(x, w, config=cfg)
        assert y.dtype == dtype and y.shape == (M, N)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (cfg, err)
        # Deterministic; the split counters were re-armed.
        assert torch.equal(y, gemv(x, w, config=cfg))


@pytest.mark.parametrize("M", [1, 5])
def test_gemv_glu_epilogue(M):
    """gemv(glu=True) on a fused [gate; up] weight = the activation kernel's gelu_tanh(gate) * up.

    Rounding points included (fp32 here: the interpreter's bf16 casts truncate); ragged output
    width.
    """
    generator = torch.Generator().manual_seed(8)
    inter, K = 37, 256
    x = torch.randn(M, K, generator=generator).to(DEV)
    w = (torch.randn(2 * inter, K, generator=generator) / 8).to(DEV)
    ref = gelu_tanh_mul(x @ w.T)
    # A K split is ignored: the epilogue needs whole sums.
    for cfg in (None, (32, 64, 4, 2, 1), (16, 128, 4, 3, 4)):
        y = gemv(x, w, config=cfg, glu=True)
        assert y.shape == (M, inter)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M", [1, 5])
def test_gemv_gelu_times_epilogue(M):
    """gemv(gelu_times=t) = gelu_tanh_times(x @ w^T, t) with whole sums and with K splits (the last
    split applies it); t a strided slice, as PLE's per-layer inputs are. fp32, ragged width."""
    generator = torch.Generator().manual_seed(10)
    N, K = 37, 512
    x = torch.randn(M, K, generator=generator).to(DEV)
    w = (torch.randn(N, K, generator=generator) / 8).to(DEV)
    times = torch.randn(M, 4, N, generator=generator).to(DEV)[:, 2]
    ref = gelu_tanh_times(x @ w.T, times)
    for cfg in (None, (32, 64, 4, 2, 1), (16, 128, 4, 3, 4)):
        y = gemv(x, w, config=cfg, gelu_times=times)
        assert y.shape == (M, N)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(y, gemv(x, w, config=cfg, gelu_times=times))


@pytest.mark.parametrize("M", [1, 5])
def test_gemv_mlp_equals_two_gemvs(M):
    """gemv_mlp = the GLU GEMV then down with the same K splits, bit for bit.

    In gemv_mlp down awaits gate_up's per-range flags. It is close to the float64 MLP; every launch
    leaves the flags re-armed at zero (a flag left set would let the next launch's down read before
    its gate_up wrote).
    """
    generator = torch.Generator().manual_seed(9)
    H, inter = 96, 600
    x = torch.randn(M, H, generator=generator).to(DEV)
    gate_up = (torch.randn(2 * inter, H, generator=generator) / 8).to(DEV)
    down = (torch.randn(H, inter, generator=generator) / 16).to(DEV)
    act = x.double() @ gate_up.double().T
    ref = (
        torch.nn.functional.gelu(act[:, :inter], approximate="tanh") * act[:, inter:]
    ) @ down.double().T
    for cfg in (None, (16, 64, 4, 2, 4), (32, 128, 4, 2, 3), (16, 64, 4, 2, 1)):
        y = gemv_mlp(x, gate_up, down, config=cfg)
        assert not _zeroed_scratch(x.device)[1].any()
        two = gemv(
            gemv(x, gate_up, glu=True), down, config=cfg or mlp_down_config(H, inter, x.device)
        )
        assert torch.equal(y, two), cfg
        assert torch.equal(y, gemv_mlp(x, gate_up, down, config=cfg))
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


def _softcap(x):  # the model's final softcap, as its bf16 torch ops round it
    return torch.tanh(x / 30.0) * 30.0


@pytest.mark.parametrize("N,K,M", [(1000, 300, 1), (1000, 256, 5), (70, 1024, 3)])
def test_greedy_head_equals_argmax_of_full_head(N, K, M):
    """greedy_head = the first argmax of G(bf16(gemv)), with G the softcap or the identity.

    On random weights, with exact ties planted (a duplicated best row must lose to its lower copy),
    with the softcap saturated (hundreds of tokens tie at 30), and with every row a candidate.
    (70, 1024) runs the exact values through gemv's two K splits.
    """
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(M, K, generator=generator).to(DEV)
    base = torch.randn(N, K, generator=generator) / 8
    tied = base.clone()
    best = (x.cpu() @ base.T).argmax(-1)[0]
    tied[N // 3] = tied[best]  # rows N//3 and best tie exactly for row 0
    # The best row for x[0] with an outlier where x is 0: its int8 copy rounds every other weight
    # to 0, so its approximate logit is far below the runner-up's (row a + 1) and only the interval
    # keeps it a candidate.
    x[:, 0] = 0
    coarse, a = base.clone(), N // 2
    coarse[a + 1] = 3 * x[0].cpu() / x[0].norm().cpu()
    coarse[a] = coarse[a + 1] + 0.01 * x[0].cpu().sign()
    coarse[a, 0] = 1e4
    cases = {
        "random": base,
        "tied": tied,
        "saturated": base * 40,
        "constant": base[:1].repeat(N, 1),
        "coarse": coarse,
    }
    for name, w in cases.items():
        w = w.to(DEV)
        q, scale = quantize_rows(w)
        for fn in (_softcap, lambda v: v):
            lut = value_table(fn, x.device)
            logits = fn(gemv(x, w).to(torch.bfloat16))
            want = logits.argmax(-1)
            if name == "coarse":
                assert want[0] == a
            got, values = greedy_head(x, w, q, scale, lut)
            assert torch.equal(got, want), (name, got, want)
            assert torch.equal(values, logits.max(-1).values.float()), name


@pytest.mark.parametrize("N", [5000, 300])
def test_first_max_equals_torch_argmax(N):
    """first_max = torch's softcap then max over bf16 logits (the table's path), and the lowest id
    among a row's maxima (the ids' path), with ties planted across chunks (5000 columns are two
    4096-column chunks), a saturated softcap (many tokens tie at 30) and a constant row."""
    from gemma4serve.model.layers import TorchOps

    generator = torch.Generator().manual_seed(5)
    M = 4
    logits = (torch.randn(M, N, generator=generator) * 4).to(torch.bfloat16)
    logits[0, N - 1] = logits[0, 7] = logits[0].max() + 1  # a tie: the lower column wins
    logits[1] *= 40  # saturated: hundreds tie after the softcap
    logits[2] = 3.0
    logits[3, [11, 12]] = torch.tensor([float("inf"), float("-inf")]).to(torch.bfloat16)
    table = value_table(_softcap, DEV)
    tokens, best, least = first_max(logits.to(DEV), table=table, floor=floor_table(table))
    want, want_tokens = _softcap(logits).max(-1)
    assert tokens[0].item() == 7 and tokens[3].item() == 11
    assert torch.equal(tokens.cpu(), want_tokens) and torch.equal(best.cpu(), want.float())
    assert torch.equal(least.cpu(), logits.min(-1).values.float())
    ids = torch.stack([torch.randperm(N, generator=generator) for _ in range(M)])
    few = logits.float().round().clamp(-2, 2).to(torch.bfloat16)  # five values: many ties
    for values in (logits, few, logits.float()):
        got = first_max(values.to(DEV), ids=ids.to(DEV))
        ref = TorchOps().first_max(values, ids=ids)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, ref)), values.dtype


def test_floor_table_gives_the_smallest_value_of_each_table_value():
    """floor[b] is the smallest bf16 value the table takes to table[b] (checked on every finite
    pattern of the softcap, and the identity); a table that decreases is refused."""
    from gemma4serve_kernels.greedy_head import every_bf16

    every = every_bf16(torch.device("cpu"))
    numbers = ~every.float().isnan()
    table = value_table(_softcap, DEV).cpu()
    floors = floor_table(table)
    x, order = every.float()[numbers].sort()
    g, f = table[numbers][order], floors[numbers][order]
    at = torch.searchsorted(x, f)  # the floor's place among the values, its first occurrence
    assert torch.equal(x[at], f) and torch.equal(g[at], g) and bool((f <= x).all())
    below = at > 0
    assert bool((g[at[below] - 1] < g[below]).all())  # the value below the floor maps lower
    assert (f != x).sum() > 1000  # the softcap takes many values to one
    identity = floor_table(every.float())
    assert torch.equal(identity[numbers], every.float()[numbers])
    assert floors[~numbers].isnan().all()
    with pytest.raises(ValueError, match="not non-decreasing"):
        floor_table(-every.float())


@pytest.mark.parametrize("N", [5000, 300])
def test_first_max_takes_nan_as_torch_argmax_does(N):
    """NaN is the largest value: a row holding NaNs gives its first NaN (torch's argmax), never
    an id outside the row (a token past the vocabulary would stop the server at its next step).
    NaNs in the last chunk only, in two chunks, everywhere; one finite row beside them."""
    from gemma4serve.model.layers import TorchOps

    generator = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, N, generator=generator) * 4).to(torch.bfloat16)
    logits[0, N - 2] = float("nan")
    logits[1, [N - 1, N // 2, 9]] = float("nan")
    logits[2] = float("nan")
    table = value_table(_softcap, DEV)
    tokens, best, _ = first_max(logits.to(DEV), table=table, floor=floor_table(table))
    capped = _softcap(logits)
    assert tokens.tolist() == capped.argmax(-1).tolist() == [N - 2, 9, 0, tokens[3].item()]
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(best.cpu(), capped.max(-1).values.float(), **exact)
    ids = torch.stack([torch.randperm(N, generator=generator) for _ in range(4)])
    got, values, _ = first_max(logits.to(DEV), ids=ids.to(DEV))
    want, want_values, _ = TorchOps().first_max(logits, ids=ids)
    assert got.tolist() == want.tolist()
    assert want[:3].tolist() == [ids[0, N - 2], ids[1, [N - 1, N // 2, 9]].min(), ids[2].min()]
    torch.testing.assert_close(values.cpu(), want_values, **exact)


def test_greedy_head_gives_a_valid_token_for_a_row_that_is_not_finite():
    """A hidden state that is not finite gets token 0 and a NaN value: torch's argmax where x holds
    a NaN (every logit NaN), and a valid token where it holds an infinity. Finite rows are exact."""
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(3, 256, generator=generator)
    w = (torch.randn(1000, 256, generator=generator) / 8).to(DEV)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x = x.to(DEV)
    q, scale = quantize_rows(w)
    lut = value_table(_softcap, x.device)
    got, values = greedy_head(x, w, q, scale, lut)
    logits = _softcap(gemv(x, w).to(torch.bfloat16))
    assert got.tolist()[1:] == [0, 0] and values[1:].isnan().all()
    assert got[0] == logits[0].argmax() and values[0] == logits[0].max().float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_limbs_hold_x(dtype):
    """The screen's x: each row = unit * (16384 a + 128 b + c) + rho, int8 limbs of at most 64.

    mass = 0.625 |x|_1 + 127 |rho|_1 (to its 1.001 margin); rows past M and columns past K are zero.
    Rows with a wide dynamic range (values the limbs cannot hold leave a residual), a zero row and a
    row of tiny values.
    """
    from gemma4serve_kernels.greedy_head import int8_limbs

    generator = torch.Generator().manual_seed(3)
    K, KP, M = 300, 512, 5
    x = torch.randn(M, K, generator=generator)
    x[1] *= torch.exp(torch.randn(K, generator=generator) * 6)  # magnitudes over ~20 binades
    x[2] = 0
    x[3] *= 1e-35
    x = x.to(dtype).to(DEV)
    limbs, unit, mass = (t.cpu() for t in int8_limbs(x, KP))
    assert limbs.abs().max() <= 64 and not limbs[:, M:].any() and not limbs[:, :, K:].any()
    a, b, c = limbs[:, :M, :K].double()
    xd = x.cpu().double()
    rho = xd - unit[:M, None].double() * (16384 * a + 128 * b + c)
    assert (rho.abs() <= unit[:M, None].double() / 2).all()
    want = 0.625 * xd.abs().sum(1) + 127 * rho.abs().sum(1)
    assert ((mass[:M].double() - want).abs() <= 2e-3 * want + 1e-38).all(), (mass[:M], want)
    assert rho[1].abs().sum() > 0  # the wide row exercises the residual term


# ---------------------------------------------------------------------------------------------- MoE
def _moe_cfg(E=8, k=3, H=32, inter=16):
    return SimpleNamespace(
        num_experts=E,
        top_k_experts=k,
        hidden_size=H,
        moe_intermediate_size=inter,
        rms_norm_eps=1e-6,
    )


def test_moe_route_matches_router():
    cfg = _moe_cfg(E=12, k=4)
    generator = torch.Generator().manual_seed(5)
    router = Router(cfg)  # stays on CPU: the reference
    with torch.no_grad():
        router.proj.weight.copy_(torch.randn(cfg.num_experts, cfg.hidden_size, generator=generator))
        router.scale.copy_(torch.rand(cfg.hidden_size, generator=generator) * 2)
        router.per_expert_scale.copy_(torch.rand(cfg.num_experts, generator=generator) * 2)
        r = torch.randn(9, cfg.hidden_size, generator=generator)
        ref_w, ref_i = router(r)
        logits = router.proj(rms_norm(r, None, cfg.rms_norm_eps) * router.scale * router.root_size)
    w, ids = moe_route(logits.to(DEV), router.per_expert_scale.detach().to(DEV), cfg.top_k_experts)
    assert torch.equal(ids.long().cpu(), ref_i)
    torch.testing.assert_close(w.cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_moe_align_blocks():
    E, k, bm = 8, 3, 16
    ids = torch.randint(0, E, (37, k), generator=torch.Generator().manual_seed(6)).to(DEV)
    ids[:5] = 2  # one crowded expert spanning several blocks
    sorted_pairs, owner = moe_align(ids, E, bm)
    sp, ow, flat = sorted_pairs.cpu(), owner.cpu(), ids.reshape(-1).cpu()
    n = flat.numel()
    used = sp[: int((ow < E).sum()) * bm]
    real = used[used < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    for b in range(int((ow < E).sum())):
        rows = sp[b * bm : (b + 1) * bm]
        rows = rows[rows < n]
        assert torch.all(flat[rows] == ow[b])
    assert torch.all(ow[int((ow < E).sum()) :] >= E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 11])
def test_moe_experts_match_reference(dtype, T):
    cfg = _moe_cfg()
    generator = torch.Generator().manual_seed(8)
    experts = Experts(cfg)  # stays on CPU: the reference
    with torch.no_grad():
        experts.gate_up_proj.copy_(
            torch.randn(experts.gate_up_proj.shape, generator=generator) * 0.3
        )
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * 0.3)
    experts = experts.to(dtype)
    x = torch.randn(T, cfg.hidden_size, generator=generator).to(dtype)
    logits = torch.randn(T, cfg.num_experts, generator=generator)
    weights, ids = moe_route(
        logits.to(DEV),
        (torch.rand(cfg.num_experts, generator=generator) + 0.5).to(DEV),
        cfg.top_k_experts,
    )
    ref = on_cpu(experts, x, weights, ids.long())
    out = moe_experts(
        x.to(DEV),
        experts.gate_up_proj.detach().to(DEV),
        experts.down_proj.detach().to(DEV),
        weights,
        ids,
        config=dict(block_n=16, block_k=16),
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # same rounding points; fp32 accumulation order differs inside the GEMMs
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_counter_random_kernel_equals_the_torch_streams():
    """The keys and uniforms of one launch are bit for bit random_streams' torch arithmetic: seeds
    of both signs and past 32 bits, positions past 2^32, both streams, 1, 5 and 8 columns."""
    from gemma4serve.engine import random_streams
    from gemma4serve_kernels import random_row_keys, random_uniform

    generator = torch.Generator().manual_seed(3)
    seed = torch.randint(-(2**62), 2**62, (300,), generator=generator)
    seed[:4] = torch.tensor([0, -1, 2**32, 2**63 - 1])
    position = torch.randint(0, 2**40, (300,), generator=generator)
    for stream in random_streams.Stream:
        want = random_streams.row_keys(seed, position, stream)
        got = random_row_keys(seed.to(DEV), position.to(DEV), stream)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), stream
        for cols in (1, 5, 8):
            want_u = random_streams.uniform(seed, position, stream, cols)
            got_u = random_uniform(seed.to(DEV), position.to(DEV), stream, cols)
            assert torch.equal(got_u.cpu(), want_u), (stream, cols)
