"""Decode-step cost against the HBM bandwidth roofline, verify cost vs k, and draft-loop cost vs k.

Every number is a CUDA-graph replay of the engine's own captured step (the path the server runs),
timed with CUDA events over many replays, on dummy weights of the real shapes. The roofline is the
bytes a step must read (weights, counting only the MoE experts a batch activates and only the
gathered rows of embedding tables, plus the KV rows every layer attends to) divided by the measured
device copy bandwidth.

  python bench/bench_step.py --model configs/gemma-4-31B-it --draft configs/gemma-4-31B-it-assistant
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4serve.config import FULL, SLIDING  # noqa: E402
from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402
from gemma4serve.engine.runner import scheduled_batch  # noqa: E402
from gemma4serve.engine.sequence import ScheduledChunk, Sequence  # noqa: E402
from gemma4serve.sampling_params import SamplingParams  # noqa: E402


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    t = time_it(lambda: b.copy_(a), iters=20)
    return 2 * n / t


def time_it(fn, iters: int = 50) -> float:
    """Median seconds per call."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for begin, finish in zip(start, end):
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(finish) for begin, finish in zip(start, end)) / 1e3


def replay_seconds(fn, iters: int = 50) -> float:
    """Median seconds of one replay of a CUDA graph that runs `fn` once, captured after an eager
    run (which compiles its kernels and picks cuBLAS's algorithms)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_it(graph.replay, iters)


def weight_bytes_read(model, batch_tokens: int) -> float:
    """Bytes of weights one forward over `batch_tokens` rows reads from HBM."""
    cfg = getattr(model, "cfg", None)
    total = 0.0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if name.endswith("embed_tokens_per_layer.weight"):  # PLE table: only the gathered rows
            nbytes = batch_tokens * param.shape[1] * param.element_size()
        elif ".experts." in name and cfg is not None and cfg.moe:
            E, k = cfg.num_experts, cfg.top_k_experts
            # The expected number of distinct experts the batch routes to.
            active = E * (1 - (1 - k / E) ** batch_tokens)
            nbytes *= active / E
        total += nbytes
    return total


def kv_bytes_read(cfg, contexts: list[int], dtype_bytes: int, window: dict) -> float:
    """KV bytes attention reads: each layer over its visible rows.

    Shared layers re-read their store layer.
    """
    total = 0.0
    for layer in cfg.layers:
        limit = window[layer.kind]
        for n in contexts:
            rows = min(n, limit) if limit else n
            total += rows * layer.num_kv_heads * layer.head_dim * 2 * dtype_bytes
    return total


def fake_decoding_sequences(
    engine: LLMEngine, batch: int, context: int, k: int
) -> list[ScheduledChunk]:
    chunks = []
    generator = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, engine.cfg.vocab_size, (context,), generator=generator).tolist()
        seq = Sequence(f"b{i}", 0, ids, context - 1, SamplingParams(), 0, i, context + k + 1)
        seq.num_computed = context - 1
        engine.kv.grow(seq, context - 1, context + k)
        chunks.append(ScheduledChunk(seq, context - 1, 1, ids[:k]))
    return chunks


def replay_target(graphs: CudaGraphs, chunks: list[ScheduledChunk], greedy: bool = False):
    """The runner's graphed decode/verify step: pack the inputs on the host, copy, replay."""
    batch = scheduled_batch(chunks)
    return graphs.run_target(
        batch.token_ids,
        batch.positions,
        batch.decode_query_len,
        batch.page_tables,
        greedy=greedy,
    )


def time_greedy(graphs: CudaGraphs, chunks: list[ScheduledChunk]) -> str:
    """The greedy variant's replay in ms ('-' where the bucket has none)."""
    B, Q = graphs.buckets[0], chunks[0].num_query
    if (B, Q, True) not in graphs.target_graphs:
        return "-"
    return f"{time_it(lambda: replay_target(graphs, chunks, greedy=True)) * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--draft", default="configs/gemma-4-31B-it-assistant")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--context", type=int, default=1128, help="tokens in context at the measured step"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# {torch.cuda.get_device_name(device)}, {datetime.date.today()}, "
        f"torch {torch.__version__}"
    )
    bw = copy_bandwidth(device)
    print(f"# measured copy bandwidth: {bw / 1e9:.0f} GB/s")

    max_b, max_k = max(args.batch), max(args.ks)
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            draft=args.draft,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max_b,
            num_draft_tokens=max_k,
            max_num_batched_tokens=max_b * (max_k + 1),
            max_model_len=args.context + 64,
            enforce_eager=True,
            attention_backend=args.attention_backend,
        )
    )
    state = engine.state
    cfg = state.target.cfg
    window = {SLIDING: cfg.sliding_window, FULL: 0}
    target_params = sum(p.numel() for p in state.target.parameters())
    draft_params = sum(p.numel() for p in state.draft.parameters())
    print(
        f"# target {args.model}: {target_params / 1e9:.2f}B params; "
        f"draft {args.draft}: {draft_params / 1e6:.0f}M params"
    )

    # The greedy variant reads the tied head as int8 (half its bytes) plus its few candidate rows
    # in bf16.
    head = state.target.embed_tokens.weight
    head_bytes = head.numel() * head.element_size()
    print(
        "\n## decode step (1 token per sequence) vs roofline; "
        "greedy: the variant that ends in the greedy head"
    )
    print(
        "| batch | context | step ms | roofline ms | % of roofline | greedy step ms "
        "| greedy roofline ms | weights GB | KV GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    decode_ms = {}
    for B in args.batch:
        chunks = fake_decoding_sequences(engine, B, args.context, 0)
        graphs = CudaGraphs(state, B, engine.max_model_len, 0)
        graphs.buckets = [B]
        graphs.capture()
        t = time_it(lambda: replay_target(graphs, chunks))
        wb = weight_bytes_read(state.target, B)
        kvb = kv_bytes_read(cfg, [args.context] * B, 2, window)
        roof = (wb + kvb) / bw
        decode_ms[B] = t * 1e3
        greedy_roof = (wb + kvb - head_bytes / 2) / bw
        print(
            f"| {B} | {args.context} | {t * 1e3:.2f} | {roof * 1e3:.2f} | {100 * roof / t:.1f}% | "
            f"{time_greedy(graphs, chunks)} | {greedy_roof * 1e3:.2f} | {wb / 1e9:.1f} | "
            f"{kvb / 1e9:.2f} |"
        )
        for ch in chunks:
            engine.kv.free(ch.seq, committed=0)
        graphs = None  # free its memory pool before the next capture
        torch.cuda.empty_cache()

    print(
        "\n## verify step (k+1 tokens per sequence) and draft loop (k drafter steps), "
        "vs the decode step"
    )
    print(
        "| batch | k | verify ms | verify / decode | greedy verify ms | draft loop ms "
        "| draft / decode |"
    )
    print("|---|---|---|---|---|---|---|")
    for B in args.batch:
        for k in args.ks:
            chunks = fake_decoding_sequences(engine, B, args.context, k)
            graphs = CudaGraphs(state, B, engine.max_model_len, k)
            graphs.buckets, graphs.q_lens, graphs.draft_lengths = [B], [k + 1], [k]
            graphs.capture()
            tv = time_it(lambda: replay_target(graphs, chunks))
            tokens = torch.zeros(B, dtype=torch.int64, device=device)
            hidden = torch.zeros(B, cfg.hidden_size, dtype=state.dtype, device=device)
            P = torch.full((B,), args.context, dtype=torch.int64, device=device)
            rows = torch.arange(B, dtype=torch.int32, device=device)
            td = time_it(lambda: graphs.run_draft(tokens, hidden, P, rows, k))
            decode = decode_ms[B]
            print(
                f"| {B} | {k} | {tv * 1e3:.2f} | {tv * 1e3 / decode:.2f}x | "
                f"{time_greedy(graphs, chunks)} | {td * 1e3:.2f} | {100 * td * 1e3 / decode:.1f}% |"
            )
            for ch in chunks:
                engine.kv.free(ch.seq, committed=0)
            graphs = None  # free its memory pool before the next capture
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
