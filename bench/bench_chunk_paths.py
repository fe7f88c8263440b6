"""One prompt chunk over a cached prefix through the engine's own forward, three ways: eager with
the tiles its context picks (what `CudaGraphs.fits_mixed` sends a long step to), eager without
the context, and the mixed CUDA graph (which cannot see it); then the host's time to queue the
eager step while the GPU is busy (a step is host-bound where that outlasts its GPU time).

    python bench/bench_chunk_paths.py --model configs/gemma-4-31B-it --chunks 16384:1024
    python bench/bench_chunk_paths.py --model configs/gemma-4-26B-A4B-it --chunks 30720:2048

Dummy weights; times are CUDA events around the forward (median of 5, ms). Each chunk's roofline
is its layers' matmul FLOPs at the matmul rate this board holds (attention not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import measure_matmul_flops  # noqa: E402

from gemma4serve.attention.metadata import to_device  # noqa: E402
from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.cuda_graphs import matmul_flops_per_row  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402
from gemma4serve.engine.runner import scheduled_batch  # noqa: E402
from gemma4serve.engine.sequence import ScheduledChunk, Sequence  # noqa: E402
from gemma4serve.model.gemma4 import ForwardContext  # noqa: E402
from gemma4serve.sampling_params import SamplingParams  # noqa: E402


def median_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--chunks", nargs="+", default=["16384:1024"], help="START:ROWS ...")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    chunks = [tuple(map(int, chunk.split(":"))) for chunk in args.chunks]
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_model_len=max(start + rows for start, rows in chunks) + 16,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    runner, state = engine.runner, engine.state
    rate = measure_matmul_flops(state.device, state.dtype)
    flops_per_row = matmul_flops_per_row(state.target)
    print(f"matmul rate for the roofline: {rate / 1e12:.0f} TFLOP/s (held 3 s)")

    def eager(batch):  # ModelRunner.forward's eager branch
        positions = to_device(batch.positions, state.device)
        meta = runner._eager_metadata(batch, positions)
        ids = to_device(batch.token_ids, state.device)
        context = ForwardContext(meta, state.kv, state.attn, runner._readout(batch))
        return state.target(ids, positions, context)

    for start, rows in chunks:
        end = start + rows
        seq = Sequence("chunk", 0, [5] * end, end, SamplingParams(), 0, 0, end + 1)
        engine.kv.grow(seq, 0, end)
        try:
            batch = scheduled_batch([ScheduledChunk(seq, start, rows, [])])
            alone = dataclasses.replace(batch, chunk_context=0)
            print(
                f"{args.model}, {rows} rows from {start}: served "
                f"{'on its graph' if runner.graphs.fits_mixed(batch) else 'eagerly'}; "
                f"matmul roofline {rows * flops_per_row / rate * 1e3:.2f} ms"
            )
            print(f"  eager, tiles by context  {median_ms(lambda: eager(batch)):.2f} ms")
            print(f"  eager, tiles by rows     {median_ms(lambda: eager(alone)):.2f} ms")
            graph = median_ms(lambda: runner.graphs.run_mixed(alone))
            print(f"  graph                    {graph:.2f} ms")
            torch.cuda.synchronize()
            torch.cuda._sleep(int(3e9))  # the GPU busy: the host alone queues the eager step
            began = time.perf_counter()
            eager(batch)
            queued = time.perf_counter() - began
            torch.cuda.synchronize()
            print(f"  host queueing the eager step: {queued * 1e3:.1f} ms", flush=True)
        finally:
            engine.kv.free(seq, committed=0)


if __name__ == "__main__":
    main()
