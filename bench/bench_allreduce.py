#!/usr/bin/env python
"""All-reduce latency at a decode step's sizes, replayed in a CUDA graph as the server replays it:
NCCL, PyTorch's symmetric-memory one-shot all-reduce (each GPU reads the others' buffers over
NVLink P2P, no multicast), and the all-reduce with the residual norm after it as the layers run
it: one-shot then the norm kernel, and the fused kernel (kernels/all_reduce_norm.py).

A 31B decode step all-reduces [rows, 5376] bf16 twice per layer (60 layers): this times one
all-reduce as the mean over a graph of --repeats of them, and prints the per-step cost and the
link roofline (bytes each GPU must read / --link-gbps) beside it.

    python bench/bench_allreduce.py --ranks 2 --rows 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 5376  # the 31B's hidden size
ALL_REDUCES_PER_STEP = 120  # two per layer, 60 layers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--repeats", type=int, default=200, help="all-reduces in one timed graph")
    p.add_argument(
        "--link-gbps", type=float, default=450.0, help="NVLink bandwidth per direction (H100/H200)"
    )
    return p.parse_args(argv)


def time_graph(fn, repeats: int) -> float:
    """Seconds per call of fn, replayed `repeats` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (3 * repeats)


def nccl(x: torch.Tensor):
    def fn():
        dist.all_reduce(x)

    return fn


def one_shot(x: torch.Tensor):
    """torch's symmetric-memory one-shot all-reduce, or None where it does not run here."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buffer = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buffer, group)
        buffer.copy_(x)

        def fn():
            torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group)

        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as e:  # noqa: BLE001 - report and time NCCL alone
        if dist.get_rank() == 0:
            print(f"one-shot all-reduce unavailable: {type(e).__name__}: {e}")
        return None


def reduce_add_norm(path, partial: torch.Tensor):
    """The all-reduce of `partial` and the residual norm after it by `path`, a callable of
    (x, partial, weight, eps, scale, next_weight) as TensorParallel.reduce_add_norm's two paths."""
    weight = torch.randn(partial.shape[1], dtype=partial.dtype, device=partial.device)
    residual = torch.randn_like(partial)

    def fn():
        path(residual, partial, weight, 1e-6, None, weight)

    return fn


def norm_paths(rank: int, ranks: int):
    """(one-shot then the norm kernel, the fused kernel) as callables of reduce_add_norm, or None
    each where they do not run here. The fused kernel is timed at every size its buffers hold,
    also past the rows the server gives it (FusedAllReduceNorm.MAX_PEER_ROWS)."""
    from gemma4serve.model.fused import FusedOps
    from gemma4serve.parallel.group import FusedAllReduceNorm, OneShotAllReduce, TensorParallel

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    one_shot = OneShotAllReduce.create(group, device)
    fused = FusedAllReduceNorm.create(TensorParallel(rank, ranks, group), device)
    plain = TensorParallel(rank, ranks, group, one_shot)
    ops = FusedOps()

    def unfused(x, partial, *norm):
        return ops.add_norm(x, plain.all_reduce(partial), *norm)

    return unfused if one_shot else None, fused


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks
    )
    dist.all_reduce(torch.ones(1, device="cuda"))  # create the communicator before capture
    unfused, fused = norm_paths(rank, args.ranks)
    if rank == 0:
        print(f"{args.ranks} ranks, {torch.cuda.get_device_name()}; times per all-reduce (us)")
        print(f"{'rows':>6} {'KiB':>8} {'NCCL':>8} {'one-shot':>9} {'link roof':>10} "
              f"{'NCCL/step ms':>13} {'one-shot+norm':>14} {'fused+norm':>11}")  # fmt: skip
    use_one_shot = True
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
        t_nccl = time_graph(nccl(x), args.repeats)
        fn = one_shot(x) if use_one_shot else None
        use_one_shot = fn is not None
        try:
            t_one = time_graph(fn, args.repeats) if fn is not None else None
        except Exception as e:  # noqa: BLE001 - e.g. not capturable in a graph
            if rank == 0:
                print(f"one-shot all-reduce in a graph failed: {type(e).__name__}: {e}")
            t_one, use_one_shot = None, False
        t_unfused = (
            time_graph(reduce_add_norm(unfused, x.clone()), args.repeats) if unfused else None
        )
        fits = fused is not None and fused.peers.fits(x)
        t_fused = time_graph(reduce_add_norm(fused, x.clone()), args.repeats) if fits else None
        nbytes = x.numel() * x.element_size()
        roof = nbytes * (args.ranks - 1) / (args.link_gbps * 1e9)
        if rank == 0:
            one, with_norm, fused_norm = (
                f"{t * 1e6:{width}.1f}" if t is not None else f"{'-':>{width}}"
                for t, width in ((t_one, 9), (t_unfused, 14), (t_fused, 11))
            )
            print(f"{rows:6d} {nbytes / 1024:8.1f} {t_nccl * 1e6:8.1f} {one} {roof * 1e6:10.1f} "
                  f"{t_nccl * ALL_REDUCES_PER_STEP * 1e3:13.2f} {with_norm} {fused_norm}",
                  flush=True)  # fmt: skip
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
