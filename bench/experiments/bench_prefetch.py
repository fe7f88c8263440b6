"""Does warming L2 with the next GEMV's first weights, from the small kernel before it, pay?

Chain per layer: gap kernel (program 0 spins ~T us; the others only prefetch) -> GEMV on W_i, 60 distinct W_i,
PDL on, captured in a CUDA graph.
"""
import sys
import itertools
import torch
import triton
import triton.language as tl
from gemma4serve_kernels._common import pdl_args, wait_for_producer
from gemma4serve_kernels.gemv import gemv, gemv_config

sys.path.insert(0, "bench")
from bench_step import time_it  # noqa


@triton.jit
def _prefetch(dummy_ptr, w_ptr, row0, rows, row_stride, pid, nprog, NBYTES: tl.constexpr, MODE: tl.constexpr,
              BLOCK: tl.constexpr):
    # rows [row0, row0 + rows) dealt round robin in BLOCK-row groups
    for r0 in range(pid * BLOCK, rows, nprog * BLOCK):
        r = tl.minimum(r0 + tl.arange(0, BLOCK), rows - 1) + row0
        if MODE == 1:  # bulk prefetch, one per row
            p = w_ptr + r.to(tl.int64) * row_stride
            tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {NBYTES}; mov.u32 $0, 0;", "=r,l",
                                      [p], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 3:  # real loads kept in L2 (evict_last), summed so they are not removed
            acc = tl.zeros([BLOCK], tl.float32)
            for c in tl.static_range(NBYTES // 256):
                p = w_ptr + r[:, None].to(tl.int64) * row_stride + (c * 128 + tl.arange(0, 128))[None, :]
                acc += tl.sum(tl.load(p, eviction_policy="evict_last").to(tl.float32), 1)
            tl.store(dummy_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)
        else:  # one prefetch per 128-byte line
            LINES: tl.constexpr = NBYTES // 128
            p = w_ptr + r[:, None].to(tl.int64) * row_stride + (tl.arange(0, LINES) * 64)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [p], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gap_kernel(x_ptr, y_ptr, n_spin, w_ptr, row0a, rowsa, row0b, rowsb, row_stride, K,
                NBYTES: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                AFTER: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if MODE != 0 and not AFTER:
        _prefetch(y_ptr + 8192, w_ptr, row0a, rowsa, row_stride, pid, nprog, NBYTES, MODE, BLOCK)
        _prefetch(y_ptr + 8192, w_ptr, row0b, rowsb, row_stride, pid, nprog, NBYTES, MODE, BLOCK)
    wait_for_producer(PDL)
    if MODE != 0 and AFTER:
        _prefetch(y_ptr + 8192, w_ptr, row0a, rowsa, row_stride, pid, nprog, NBYTES, MODE, BLOCK)
        _prefetch(y_ptr + 8192, w_ptr, row0b, rowsb, row_stride, pid, nprog, NBYTES, MODE, BLOCK)
    if pid == 0:
        k = tl.arange(0, BK)
        v = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        for _ in range(n_spin):
            v = v * 0.999 + 0.001
        tl.store(y_ptr + k, v.to(y_ptr.dtype.element_ty), mask=k < K)


def gap(x, n_spin, w, ranges, nbytes, mode, programs, after=False):
    y = torch.empty(8192 + 132 * 128, dtype=x.dtype, device=x.device)
    (a0, an), (b0, bn) = ranges
    K = x.shape[1]
    _gap_kernel[(programs,)](x, y, n_spin, w, a0, an, b0, bn, w.stride(0), K, NBYTES=nbytes, MODE=mode,
                             BLOCK=128, BK=triton.next_power_of_2(K), AFTER=after, num_warps=4, **pdl_args(x.device))
    return y[:x.shape[1]].view(1, -1)


def replay_ms(fn, iters=10):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_it(g.replay, iters) * 1e3


def main():
    L = 40
    # rows the GEMV's first wave reads (gate_up: 132 programs of 32 gate + 32 up rows; qkv: 132 x 64 rows;
    # o_proj: 168 x 32 rows, all resident at 2 per SM)
    shapes = {"gate_up": (43008, 5376, [(0, 4224), (21504, 4224)]), "o_proj": (5376, 8192, [(0, 5376), (0, 0)])}
    print(torch.cuda.get_device_name())
    for name, (N, K, ranges) in shapes.items():
        ws = [torch.empty(N, K, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02) for _ in range(L)]
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        glu = name == "gate_up"
        t_gemv = replay_ms(lambda: [gemv(x, w, glu=glu) for w in ws]) / L * 1e3
        print(f"\n## {name} {N}x{K}: gemv alone {t_gemv:.1f} us/layer; ranges {ranges}")
        for spin in (1500,):
            t_gap = replay_ms(lambda: [gap(x, spin, ws[i], ranges, 512, 0, 1) for i in range(L)]) / L * 1e3
            base = None
            for mode, nbytes, programs, after in [(0, 512, 132, 0), (3, 1024, 132, 1), (3, 2048, 132, 1),
                                                  (3, 4096, 132, 1), (2, 2048, 132, 1)]:
                def chain():
                    for w in ws:
                        h = gap(x, spin, w, ranges, nbytes, mode, programs, after)
                        gemv(h, w, glu=glu)
                t = replay_ms(chain) / L * 1e3
                base = base or t
                mb = sum(r for _, r in ranges) * nbytes / 1e6 if mode else 0
                print(f"spin {spin:5d} (gap alone {t_gap:5.1f} us) mode {mode} {nbytes:5d} B/row ({mb:5.1f} MB) "
                      f"after wait {after}: {t:6.1f} us/layer  ({t - base:+.1f})")
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
