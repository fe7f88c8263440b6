"""Paged-attention bandwidth on the GPU at a model's shapes (the 31B's by default).

Decode, verify (--verify-rows a sequence, 3 by default: two drafts, what the draft length
chooses at the forced acceptance of 3.1) and 1024-token prefill chunks; "mixed" is a served step's
layout: `batch` verifications and prompt chunks filling the server's default token budget (one
first chunk, or with --prompt-len whole prompts of that length and the first piece of the next),
padded as the mixed CUDA graphs pad it (with empty groups to the server's sequence bucket); its
row is followed by its parts alone. "prompts" is those prompt chunks alone (the prefill tiles'
case for --sweep). Shapes are the --model's (the 31B by default).

    python bench/bench_kernels.py            # the table
    # Also search configs (slow: limit it).
    python bench/bench_kernels.py --sweep --layers full --batches 1
    # K and V where the server keeps them: each page holds every layer, pages spread over GiBs.
    python bench/bench_kernels.py --phases verify --batches 32 --contexts 1100 --arena-gib 60
    # One rank's heads under tensor parallelism (its splits and tiles at batch 1).
    python bench/bench_kernels.py -tp 2 --phases decode --batches 1 --contexts 1100 --sweep

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

from gemma4serve.config import FULL, SLIDING, TextConfig, load_config
from gemma4serve.engine.args import EngineArgs
from gemma4serve.kv.cache import KVCache, page_tokens
from gemma4serve.parallel.shards import shard_text_config
from gemma4serve_kernels import attention_config, paged_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import copy_bandwidth  # noqa: E402

PAGE = 16
DT = torch.bfloat16
PREFILL_ROWS = 1024  # query rows of one prefill chunk


def text_config(model: str, tp: int) -> TextConfig:
    """The model's config, or with `tp` > 1 one rank's (heads split as tensor parallelism does)."""
    cfg = load_config(model)
    return shard_text_config(cfg, tp) if tp > 1 else cfg


def shapes_of(cfg: TextConfig) -> dict:
    """Attention shapes of the full and sliding layers (and the first producer layer of each, whose
    K and V an arena gives)."""
    shapes = {}
    for layer in cfg.producer_layers:
        window = cfg.sliding_window if layer.kind == SLIDING else 0
        name = "sliding" if window else "full"
        shapes.setdefault(
            name,
            dict(
                nh=cfg.num_heads,
                nkv=layer.num_kv_heads,
                hd=layer.head_dim,
                window=window,
                layer=layer.index,
            ),
        )
    return shapes


def served_arena(cfg: TextConfig, gib: float) -> KVCache:
    """`gib` GiB of the server's KV arena: pages of every producer layer's K and V at the default
    page size, filled with random values."""
    tokens = page_tokens(cfg, EngineArgs.page_size)
    num_pages = int(gib * 2**30) // KVCache.bytes_per_page(cfg, tokens, DT)
    arena = KVCache(cfg, num_pages, tokens, DT, "cuda")
    arena.arena.normal_()
    return arena


def kv_pages(shape: dict, count: int, arena: KVCache | None):
    """K and V caches [pages, page tokens, nkv, hd] and `count` distinct pages of them in a random
    order (page 0 unused, as the server's null page): a cache of its own per case, or the layer's
    view of the served arena (its pages a whole arena page apart), pages drawn from all of it."""
    if arena is None:
        k_cache = torch.randn(1 + count, PAGE, shape["nkv"], shape["hd"], device="cuda", dtype=DT)
        return k_cache, torch.randn_like(k_cache), torch.randperm(count, device="cuda") + 1
    k_cache, v_cache = arena.layer(shape["layer"])
    if count >= k_cache.shape[0]:
        raise SystemExit(f"--arena-gib holds {k_cache.shape[0] - 1} pages; this case needs {count}")
    pages = torch.randperm(k_cache.shape[0] - 1, device="cuda")[:count] + 1
    return k_cache, v_cache, pages


def build_groups(shape: dict, groups: list[tuple[int, int]], arena: KVCache | None = None):
    """Paged attention's arguments for sequence groups [(committed positions, query rows)]: each
    group's rows are its last positions; pages in a random order (see kv_pages). Also the bytes
    moved (the K and V rows the queries can see, q read, output written) and the FLOPs of q·k and
    p·v."""
    nh, nkv, hd, window = shape["nh"], shape["nkv"], shape["hd"], shape["window"]
    page = arena.page_tokens[SLIDING if window else FULL] if arena else PAGE
    pages = [triton.cdiv(ctx, page) for ctx, _ in groups]
    k_cache, v_cache, phys = kv_pages(shape, sum(pages), arena)
    table = torch.zeros(len(groups), max(pages), dtype=torch.int32, device="cuda")
    for i, (first, count) in enumerate(zip(itertools.accumulate([0] + pages), pages)):
        table[i, :count] = phys[first : first + count]
    T = sum(rows for _, rows in groups)
    q = torch.randn(T, nh, hd, device="cuda", dtype=DT) * hd**-0.5
    ends = torch.cat(
        [torch.arange(ctx - rows + 1, ctx + 1, dtype=torch.int32) for ctx, rows in groups]
    )
    token_seq = torch.cat(
        [torch.full((rows,), i, dtype=torch.int32) for i, (_, rows) in enumerate(groups)]
    )
    cu = torch.tensor([0, *itertools.accumulate(rows for _, rows in groups)], dtype=torch.int32)
    nbytes, flops = 2 * q.numel() * 2, 0
    for ctx, rows in groups:
        # keys one group's rows read together; each row attends to at most a window of them
        nbytes += min(ctx, window + rows - 1 if window else ctx) * nkv * hd * 2 * 2
        seen = torch.arange(ctx - rows + 1, ctx + 1)
        flops += 4 * nh * hd * int((seen.clamp(max=window) if window else seen).sum())
    args = (q, k_cache, v_cache, token_seq.cuda(), ends.cuda(), table, cu.cuda(),
            max(rows for _, rows in groups), window)  # fmt: skip
    return args, nbytes, flops


def build(shape: dict, batch: int, ctx: int, rows: int, arena: KVCache | None = None):
    """`batch` sequences of `ctx` committed positions, each with its last `rows` as queries."""
    args, nbytes, _ = build_groups(shape, [(ctx, rows)] * batch, arena)
    return args, nbytes


def prompt_chunks(
    batch: int, verify_rows: int, prompt_len: int | None, tokens: int
) -> list[tuple[int, int]]:
    """The prompt chunks that fill a step of `tokens` beside `batch` verifications: one first
    chunk, or whole prompts of `prompt_len` and the first piece of the next."""
    budget = tokens - batch * verify_rows
    if prompt_len is None:
        return [(budget, budget)]
    pieces = [prompt_len] * (budget // prompt_len) + [budget % prompt_len]
    return [(rows, rows) for rows in pieces if rows]


def build_mixed(
    shape: dict,
    batch: int,
    ctx: int,
    verify_rows: int,
    prompt_len: int | None,
    tokens: int,
    arena: KVCache | None = None,
):
    """`batch` verifying sequences at `ctx` and the prompt chunks beside them, with empty groups
    up to the sequence bucket (of the server's default 256 sequences) as
    gemma4serve/engine/cuda_graphs.py's mixed graphs pad them."""
    from gemma4serve.engine.cuda_graphs import mixed_group_buckets

    verify = [(ctx, verify_rows)] * batch
    groups = verify + prompt_chunks(batch, verify_rows, prompt_len, tokens)
    args, nbytes, flops = build_groups(shape, groups, arena)
    bucket = next(g for g in mixed_group_buckets(256) if g >= len(groups))
    cu = args[6]
    cu = torch.cat([cu, cu.new_full((bucket + 1 - len(groups),), tokens)])
    return (*args[:6], cu, tokens, args[8]), nbytes, flops


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
    short_block_n_opts=None,
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
    short_block_n_opts = short_block_n_opts or (base.get("short_block_n"),)
    results = []
    out = torch.empty_like(args[0])
    for block_t, block_n, short_block_n, warps, stages, split in itertools.product(
        block_t_opts, block_n_opts, short_block_n_opts, warps_opts, stages_opts, split_opts
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
        short = {} if short_block_n is None else dict(short_block_n=short_block_n)
        cfg.update(short)
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
                dict(
                    block_t=block_t,
                    block_n=block_n,
                    **short,
                    num_warps=warps,
                    num_stages=stages,
                    **split,
                ),
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
    parser.add_argument("--model", default="configs/gemma-4-31B-it", help="the shapes' config")
    parser.add_argument(
        "--prompt-len", type=int, help="mixed and prompts: whole prompts of this length"
    )
    parser.add_argument(
        "--verify-rows", type=int, default=3, help="query rows of a verifying sequence"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineArgs.max_num_batched_tokens,
        help="mixed and prompts: the step's tokens (the server's token budget)",
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--layers", default="full,sliding")
    parser.add_argument(
        "--phases", default="decode,verify", help="of decode, verify, prefill, mixed, prompts"
    )
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
        "--short-block-n",
        help="mixed: key tile options of the decoding and verifying groups' short tiles",
    )
    parser.add_argument(
        "--splits", help='split settings of the sweep, "num_splits:min_split_keys,..." or "default"'
    )
    parser.add_argument(
        "--arena-gib",
        type=float,
        default=0,
        help="read K and V from this many GiB of the server's KV arena (its layout: a page holds "
        "every layer, pages drawn at random from all of it) instead of a cache per case",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="one rank's heads (query and KV heads split as tensor parallelism splits them)",
    )
    cli = parser.parse_args()
    phase_rows = {"decode": 1, "verify": cli.verify_rows, "prefill": PREFILL_ROWS}
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
    if cli.short_block_n:
        options.update(short_block_n_opts=tuple(map(int, cli.short_block_n.split(","))))

    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda")) / 1e9  # GB/s
    print(f"device: {torch.cuda.get_device_name()}   measured copy bandwidth: {bw:,.0f} GB/s\n")
    head = (
        f"{'layer':8s} {'phase':7s} {'batch':>5s} {'ctx':>6s} {'MB moved':>9s} {'us':>8s} "
        f"{'GB/s':>7s} {'% copy':>7s} {'graph us':>9s}"
    )
    print(head + ("   best (sweep, graph us)" if cli.sweep else ""))
    print("-" * len(head))
    cfg = text_config(cli.model, cli.tensor_parallel_size)
    shapes = shapes_of(cfg)
    arena = served_arena(cfg, cli.arena_gib) if cli.arena_gib else None
    for name in cli.layers.split(","):
        shape = shapes[name]
        for phase in cli.phases.split(","):
            for batch in map(int, cli.batches.split(",")):
                for ctx in map(int, cli.contexts.split(",")):
                    parts, flops = {}, None
                    if phase == "mixed":
                        args, nbytes, flops = build_mixed(
                            shape,
                            batch,
                            ctx,
                            cli.verify_rows,
                            cli.prompt_len,
                            cli.max_num_batched_tokens,
                            arena,
                        )
                        parts["verify"] = build(shape, batch, ctx, cli.verify_rows, arena)[0]
                        parts["prompts"] = build_groups(
                            shape,
                            prompt_chunks(
                                batch, cli.verify_rows, cli.prompt_len, cli.max_num_batched_tokens
                            ),
                            arena,
                        )[0]
                    elif phase == "prompts":
                        groups = prompt_chunks(
                            batch, cli.verify_rows, cli.prompt_len, cli.max_num_batched_tokens
                        )
                        args, nbytes, flops = build_groups(shape, groups, arena)
                    else:
                        args, nbytes = build(shape, batch, ctx, phase_rows[phase], arena)
                    ms, graph_ms = time_case(args)
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    line = (
                        f"{name:8s} {phase:7s} {batch:5d} {ctx:6d} {nbytes / 1e6:9.1f} "
                        f"{ms * 1e3:8.1f} {gbs:7.0f} {100 * gbs / bw:6.1f}% {graph_ms * 1e3:9.1f}"
                    )
                    if flops is not None:
                        line += f"  ({flops / (graph_ms * 1e-3) / 1e12:.0f} TFLOP/s)"
                    for part, part_args in parts.items():
                        line += (
                            f"\n      {part} alone: {time_case(part_args)[1] * 1e3:.1f} graph us"
                        )
                    if cli.sweep:
                        ranked = sweep(
                            args, shape["hd"], shape["nh"] // shape["nkv"], args[7], **options
                        )
                        line += "".join(
                            f"\n      {ms * 1e3:6.1f} us "
                            f"({100 * nbytes / (ms * 1e-3) / 1e9 / bw:3.0f}%) {cfg}"
                            for ms, cfg in ranked[: cli.top]
                        )
                    print(line, flush=True)
                    del args, parts
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
