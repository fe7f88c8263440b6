"""Paged-attention bandwidth on the GPU at the 31B shapes.

Decode, 5-row verify and 1024-token prefill chunks; "mixed" is a served step's layout: `batch`
5-row verifications and a prompt chunk filling the 2048-token budget, padded as the mixed CUDA
graphs pad it (to the token bucket, and with empty groups to the server's sequence bucket).

    python bench/bench_kernels.py            # the table
    # Also search configs (slow: limit it).
    python bench/bench_kernels.py --sweep --layers full --batches 1

Decode and verify are memory-bound, so the figure of merit is bytes moved / time against the copy
bandwidth this script measures on the same GPU (a large device-to-device copy: read + write bytes).
Bytes moved = the K and V rows the queries can see (window-limited for sliding layers) + q read +
output written; the split-K partials are overhead and are not counted. Times come from
triton.testing.do_bench, which flushes L2 before every run, so small working sets are not served
from cache; "graph" is the same launch replayed from a CUDA graph (what the engine does), which
removes the host launch cost.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from gemma4serve_kernels import attention_config, paged_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import copy_bandwidth  # noqa: E402

SHAPES = {  # 31B: 32 query heads
    "full": dict(nh=32, nkv=4, hd=512, window=0),
    "sliding": dict(nh=32, nkv=16, hd=256, window=1024),
}
PAGE = 16
DT = torch.bfloat16
PHASE_ROWS = {
    "decode": 1,
    "verify": 5,
    "prefill": 1024,
    "mixed": 5,
}  # query rows per sequence (prefill: one chunk; mixed: per verifying sequence)
MIXED_TOKENS = 2048  # the server's default token budget


def build(shape: dict, batch: int, ctx: int, rows: int):
    """Every sequence has `ctx` committed positions; its `rows` query rows are the last ones."""
    nh, nkv, hd, window = shape["nh"], shape["nkv"], shape["hd"], shape["window"]
    pages_per = triton.cdiv(ctx, PAGE)
    num_pages = 1 + batch * pages_per
    phys = (torch.randperm(num_pages - 1, device="cuda") + 1).to(torch.int32)
    table = phys.view(batch, pages_per).contiguous()
    k_cache = torch.randn(num_pages, PAGE, nkv, hd, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    T = batch * rows
    q = torch.randn(T, nh, hd, device="cuda", dtype=DT) * hd**-0.5
    ends = torch.arange(ctx - rows + 1, ctx + 1, dtype=torch.int32, device="cuda").repeat(batch)
    token_seq = torch.arange(batch, dtype=torch.int32, device="cuda").repeat_interleave(rows)
    cu = torch.arange(0, T + 1, rows, dtype=torch.int32, device="cuda")
    visible = (
        min(ctx, window + rows - 1) if window else ctx
    )  # keys one sequence's rows read together
    nbytes = batch * visible * nkv * hd * 2 * 2 + 2 * q.numel() * 2
    args = (q, k_cache, v_cache, token_seq, ends, table, cu, rows, window)
    return args, nbytes


def build_mixed(shape: dict, batch: int, ctx: int):
    """`batch` verifying sequences at `ctx` and a prompt's first chunk filling the budget, with
    empty groups up to the sequence bucket (of the server's default 256 sequences) as
    gemma4serve/engine/cuda_graphs.py's mixed graphs pad them."""
    from gemma4serve.engine.cuda_graphs import mixed_group_buckets

    rows = PHASE_ROWS["verify"]
    chunk = MIXED_TOKENS - batch * rows
    args, nbytes = build(shape, batch, ctx, rows)
    chunk_args, chunk_bytes = build(shape, 1, chunk, chunk)  # a prompt's first chunk
    q, k_cache, v_cache, token_seq, ends, table, cu = args[:7]
    cq, ck, cv, _, c_ends, c_table, _ = chunk_args[:7]
    offset = k_cache.shape[0] - 1  # the chunk's pages after the verifications' (page 0 shared)
    k_cache, v_cache = torch.cat([k_cache, ck[1:]]), torch.cat([v_cache, cv[1:]])
    width = max(table.shape[1], c_table.shape[1])
    table = torch.cat(
        [
            torch.nn.functional.pad(table, (0, width - table.shape[1])),
            torch.nn.functional.pad(c_table + offset, (0, width - c_table.shape[1])),
        ]
    )
    groups = batch + 1
    group_bucket = next(g for g in mixed_group_buckets(256) if g >= groups)
    # The chunk's group ends the rows; the empty ones after it pad to the bucket's G + 1 groups.
    cu = torch.cat([cu, cu.new_full((group_bucket + 2 - groups,), MIXED_TOKENS)])
    token_seq = torch.cat([token_seq, token_seq.new_full((chunk,), batch)])
    mixed = (
        torch.cat([q, cq]),
        k_cache,
        v_cache,
        token_seq,
        torch.cat([ends, c_ends]),
        table,
        cu,
        MIXED_TOKENS,
        shape["window"],
    )
    return mixed, nbytes + chunk_bytes


def time_case(args, **kw):
    out = torch.empty_like(args[0])
    fn = lambda: paged_attention(*args, out=out, **kw)  # noqa: E731
    fn()
    ms = do_bench(fn, warmup=25, rep=200)
    graph_ms = do_bench_cudagraph(fn, rep=200)
    return ms, graph_ms


DEFAULT_SPLITS = (
    dict(),
    dict(min_split_keys=32),
    dict(min_split_keys=64),
    dict(min_split_keys=256),
    dict(num_splits=1),
    dict(num_splits=8, min_split_keys=64),
    dict(num_splits=32, min_split_keys=32),
)


def parse_splits(text: str) -> tuple[dict, ...]:
    """Parse "8:64,16:32" -> ({num_splits: 8, min_split_keys: 64}, ...).

    "default" stands for the engine's own choice.
    """
    out = []
    for item in text.split(","):
        if item == "default":
            out.append(dict())
        else:
            n, keys = map(int, item.split(":"))
            out.append(dict(num_splits=n, min_split_keys=keys))
    return tuple(out)


def sweep(
    args,
    hd,
    group,
    rows,
    warps_opts=None,
    stages_opts=None,
    block_n_opts=(16, 32, 64),
    split_opts=DEFAULT_SPLITS,
    block_t_opts=None,
):
    """Time tile configs and split counts around the defaults, fastest first: [(ms, settings)].

    Warps and stages not given stay the engine's default for the case.

    The K/V loads are indirect (through the page table), so the software pipeliner spends one stage
    on the page ids: with triton 3.6, num_stages 2-4 keep one K/V tile in flight ahead of the math
    and 5 keeps two (more shared memory, fewer resident programs); check on the GPU's triton.
    """
    base = attention_config(hd, group, rows)
    warps_opts = warps_opts or (base["num_warps"],)
    stages_opts = stages_opts or (base["num_stages"],)
    block_t_opts = block_t_opts or (base["block_t"],)
    results = []
    out = torch.empty_like(args[0])
    for block_t, block_n, warps, stages, split in itertools.product(
        block_t_opts, block_n_opts, warps_opts, stages_opts, split_opts
    ):
        # query tokens per program (times the GQA group: the accumulator's rows)
        cfg = dict(
            base,
            block_t=block_t,
            block_m=max(16, block_t * triton.next_power_of_2(group)),
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        fn = lambda: paged_attention(*args, out=out, config=cfg, **split)  # noqa: E731
        try:
            fn()
        except Exception:  # out of shared memory / registers for this combination
            continue
        # Replayed from a CUDA graph, as the engine runs it: at batch 1 a launch costs more than
        # the kernel.
        ms = do_bench_cudagraph(fn, rep=20)
        results.append(
            (
                ms,
                dict(block_t=block_t, block_n=block_n, num_warps=warps, num_stages=stages, **split),
            )
        )
    return sorted(results, key=lambda r: r[0])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also search tile configs / splits per case"
    )
    parser.add_argument(
        "--splits-only",
        action="store_true",
        help="sweep only block_n and the split settings, keeping the default warps / stages",
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--layers", default="full,sliding")
    parser.add_argument("--phases", default="decode,verify")
    parser.add_argument("--warps", default="4,8", help="num_warps options of the sweep")
    parser.add_argument("--stages", default="3,5", help="num_stages options of the sweep")
    parser.add_argument(
        "--top", type=int, default=1, help="how many of the sweep's fastest settings to print"
    )
    parser.add_argument("--block-n", default="16,32,64", help="block_n options of the sweep")
    parser.add_argument(
        "--block-t", help="query tokens per program options of the sweep (default: the engine's)"
    )
    parser.add_argument(
        "--splits", help='split settings of the sweep, "num_splits:min_split_keys,..." or "default"'
    )
    cli = parser.parse_args()
    options = dict(block_n_opts=tuple(map(int, cli.block_n.split(","))))
    if not cli.splits_only:
        options.update(
            warps_opts=tuple(map(int, cli.warps.split(","))),
            stages_opts=tuple(map(int, cli.stages.split(","))),
        )
    if cli.splits:
        options.update(split_opts=parse_splits(cli.splits))
    if cli.block_t:
        options.update(block_t_opts=tuple(map(int, cli.block_t.split(","))))

    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda")) / 1e9  # GB/s
    print(f"device: {torch.cuda.get_device_name()}   measured copy bandwidth: {bw:,.0f} GB/s\n")
    head = (
        f"{'layer':8s} {'phase':7s} {'batch':>5s} {'ctx':>6s} {'MB moved':>9s} {'us':>8s} "
        f"{'GB/s':>7s} {'% copy':>7s} {'graph us':>9s}"
    )
    print(head + ("   best (sweep, graph us)" if cli.sweep else ""))
    print("-" * len(head))
    for name in cli.layers.split(","):
        shape = SHAPES[name]
        for phase in cli.phases.split(","):
            rows = PHASE_ROWS[phase]
            for batch in map(int, cli.batches.split(",")):
                for ctx in map(int, cli.contexts.split(",")):
                    if phase == "mixed":
                        args, nbytes = build_mixed(shape, batch, ctx)
                    else:
                        args, nbytes = build(shape, batch, ctx, rows)
                    ms, graph_ms = time_case(args)
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    line = (
                        f"{name:8s} {phase:7s} {batch:5d} {ctx:6d} {nbytes / 1e6:9.1f} "
                        f"{ms * 1e3:8.1f} {gbs:7.0f} {100 * gbs / bw:6.1f}% {graph_ms * 1e3:9.1f}"
                    )
                    if cli.sweep:
                        ranked = sweep(
                            args, shape["hd"], shape["nh"] // shape["nkv"], rows, **options
                        )
                        line += "".join(
                            f"\n      {ms * 1e3:6.1f} us "
                            f"({100 * nbytes / (ms * 1e-3) / 1e9 / bw:3.0f}%) {cfg}"
                            for ms, cfg in ranked[: cli.top]
                        )
                    print(line, flush=True)
                    del args
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
