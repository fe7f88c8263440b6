"""Prototype: a GEMV whose programs fill an S-deep shared-memory ring with weight tiles (cp.async) BEFORE waiting
on the previous kernel (PDL), so the weight stream starts while the producer drains."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _gdc(x):
    return gl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, $1;",
                                     "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _round_bf16(x):
    u = x.to(gl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(gl.float32, bitcast=True)


@gluon.jit
def _gelu_tanh(x):
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = gl.exp(-2.0 * gl.abs(z))
    th = (1.0 - e) / (1.0 + e)
    return 0.5 * x * (1.0 + gl.where(z < 0.0, -th, th))


@gluon.jit
def gemv_ring_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, PDL: gl.constexpr,
                     GLU: gl.constexpr, num_warps: gl.constexpr):
    tile = gl.program_id(0)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    sh: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

    w_s = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], sh)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [S, BM, BK], sh)

    j = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    if GLU:  # BN/2 gate rows and the matching up rows ([gate; up] is [2N, K])
        HALF: gl.constexpr = BN // 2
        col = tile * HALF + j % HALF
        rn = col + (j // HALF) * N
        row_ok = col < N
    else:
        rn = tile * BN + j
        row_ok = rn < N
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    rm = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    w_ptrs = w_ptr + rn[:, None].to(gl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    n_ok = row_ok[:, None] & (rk < BK)[None, :]
    m_ok = (rm < M)[:, None] & (rk < BK)[None, :]
    KT = K // BK

    # weights never depend on the previous kernel: fill the ring before waiting for it
    for j in gl.static_range(S):
        cp.async_copy_global_to_shared(w_s.index(j), w_ptrs + j * BK, mask=n_ok & (j < KT),
                                       eviction_policy="evict_first")
        cp.commit_group()
    if PDL:
        _gdc(gl.full([1], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [num_warps], [0])))
    for j in gl.static_range(S):
        cp.async_copy_global_to_shared(x_s.index(j), x_ptrs + j * BK, mask=m_ok & (j < KT))
        cp.commit_group()

    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    for i in range(KT):
        s = i % S
        cp.wait_group(S - 1)
        gl.thread_barrier()
        a = x_s.index(s).load(a_l)
        b = w_s.index(s).permute((1, 0)).load(b_l)
        acc = mma_v2(a, b, acc)
        gl.thread_barrier()
        nxt = i + S
        cp.async_copy_global_to_shared(w_s.index(s), w_ptrs + nxt * BK, mask=n_ok & (nxt < KT),
                                       eviction_policy="evict_first")
        cp.async_copy_global_to_shared(x_s.index(s), x_ptrs + nxt * BK, mask=m_ok & (nxt < KT))
        cp.commit_group()
    cp.wait_group(0)

    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    om = gl.arange(0, BM, layout=gl.SliceLayout(1, out_l))
    if GLU:
        # the halves of the accumulator through shared memory (gate columns, then up columns)
        acc_s = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        acc_s.store(acc)
        gl.thread_barrier()
        gate = acc_s.slice(0, HALF, dim=1).load(out_l)
        up = acc_s.slice(HALF, HALF, dim=1).load(out_l)
        y = _round_bf16(_round_bf16(_gelu_tanh(_round_bf16(gate))) * _round_bf16(up))
        on = tile * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, out_l))
        gl.store(y_ptr + om[:, None] * stride_ym + on[None, :], y.to(gl.bfloat16),
                 mask=(om < M)[:, None] & (on < N)[None, :])
    else:
        out = gl.convert_layout(acc, out_l).to(gl.bfloat16)
        on = tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
        gl.store(y_ptr + om[:, None] * stride_ym + on[None, :], out, mask=(om < M)[:, None] & (on < N)[None, :])


def gemv_ring(x, w, BN=64, BK=256, S=4, num_warps=4, pdl=True, glu=False):
    import torch
    import triton
    M, K = x.shape
    N = w.shape[0] // (2 if glu else 1)
    assert K % BK == 0
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    tiles = triton.cdiv(N, BN // 2 if glu else BN)
    gemv_ring_kernel[(tiles,)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=16, BN=BN,
                               BK=BK, S=S, PDL=pdl, GLU=glu, num_warps=num_warps, **extra)
    return y
