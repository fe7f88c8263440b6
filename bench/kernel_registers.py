"""Registers, spills and shared memory of the attention kernel's tiles on sm_90, compiled on a CPU.

Triton compiles for a GPU target without a GPU (its wheel carries ptxas), so what a tile shape
costs in registers can be checked before spending device time on it. Numbers match the device
only with its Triton version (3.6 with torch 2.11):

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python bench/kernel_registers.py --head-dim 256 --group 2 \\
        --block-t 32 --block-n 32 --warps 4 --stages 2 --query-rows 1024

The last column digests the PTX without its debug information: a refactor of the kernel's source
that keeps every tile's digest compiles to the same code.

Integer arguments are compiled as the launch specialises them (pointers and strides divisible by
16): without that hint Triton cannot prove the K/V rows aligned and loads them without async copies.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gemma4serve_kernels.paged_attention import _attn_kernel, table_chunk

POINTERS = dict(
    q_ptr="*bf16",
    k_ptr="*bf16",
    v_ptr="*bf16",
    o_ptr="*bf16",
    part_o_ptr="*fp32",
    part_lse_ptr="*fp32",
    token_seq_ptr="*i32",
    kv_end_ptr="*i32",
    table_ptr="*i32",
    cu_ptr="*i32",
)


def ptxas_report(ptx: str) -> str:
    """ptxas -v on `ptx` with the first bundled ptxas that accepts its PTX version."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            run = subprocess.run(
                [bin_dir / name, "-v", "--gpu-name", "sm_90a", src, "-o", Path(tmp) / "k.cubin"],
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                return run.stderr
    raise RuntimeError(run.stderr)


def compile_attention(
    head_dim,
    group,
    block_t,
    block_n,
    warps,
    stages,
    query_rows,
    page=16,
    split=False,
    value_parts=1,
):
    group_p = triton.next_power_of_2(group)
    entries, chunk = table_chunk(page, block_n)
    prefill = query_rows > 8
    # A prefill launch's short groups take 16-row tiles of their own; elsewhere they repeat the main
    # tiles (as `paged_attention` launches them).
    short_m = max(16, group_p) if prefill else max(16, block_t * group_p)
    constants = dict(
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_T=block_t,
        BLOCK_M=max(16, block_t * group_p),
        BLOCK_N=block_n,
        SPLIT=split,
        MIN_BLOCKS=1,
        DOT_FP32=False,
        PDL=True,
        TABLE_CHUNK=entries,
        CHUNK_TILES=chunk,
        SHORT_T=short_m // group_p if prefill else block_t,
        SHORT_M=short_m,
        SHORT_N=block_n,
        SHORT_MIN_BLOCKS=1,
        SHORT_TABLE_CHUNK=entries,
        SHORT_CHUNK_TILES=chunk,
        LAUNCH_NEXT_LATE=False,
        PREFILL=prefill,
        VALUE_PARTS=value_parts,
    )
    names = _attn_kernel.arg_names
    signature = {
        name: "constexpr" if name in constants else POINTERS.get(name, "i32") for name in names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if name in POINTERS or name.startswith("stride")
    }
    source = ASTSource(
        _attn_kernel,
        signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs=aligned,
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = re.search(r"(\d+) bytes spill stores", report)
    return dict(
        registers=registers,
        spill_bytes=int(spill.group(1)) if spill else 0,
        shared_kib=compiled.metadata.shared / 1024,
        async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
        code_digest=code_digest(ptx),
    )


def code_digest(ptx: str) -> str:
    """A digest of the PTX's instructions without its debug information (line markers, DWARF
    sections, scope labels), so a refactor that compiles to the same code keeps the digest."""
    code = ptx.split(".section\t.debug")[0]
    lines = [
        line
        for line in code.splitlines()
        if not line.strip().startswith((".loc", ".file", "//"))
        and not re.fullmatch(r"\$L__tmp\d+:", line.strip())
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = dict(type=int, nargs="+")
    parser.add_argument("--head-dim", **ints, default=[256])
    parser.add_argument("--group", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--block-t", **ints, default=[32])
    parser.add_argument("--block-n", **ints, default=[32])
    parser.add_argument("--warps", **ints, default=[4])
    parser.add_argument("--stages", **ints, default=[2])
    parser.add_argument("--query-rows", type=int, default=1024, help="rows per sequence")
    parser.add_argument(
        "--split", action="store_true", help="the split-KV variant (partials for the merge)"
    )
    parser.add_argument(
        "--value-parts", type=int, default=1, help="prefill: programs sharing a row's value columns"
    )
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90a")
    print(
        "head_dim block_t block_n warps stages | registers spill_bytes shared_KiB async_copies "
        "code_digest"
    )
    for hd, bt, bn, warps, stages in itertools.product(
        args.head_dim, args.block_t, args.block_n, args.warps, args.stages
    ):
        try:
            r = compile_attention(
                hd,
                args.group,
                bt,
                bn,
                warps,
                stages,
                args.query_rows,
                split=args.split,
                value_parts=args.value_parts,
            )
            result = (
                f"{r['registers']:9d} {r['spill_bytes']:11d} {r['shared_kib']:10.0f} "
                f"{r['async_copies']:12d} {r['code_digest']}"
            )
        except Exception as error:  # out of registers or shared memory for this shape
            result = f"fails: {str(error).splitlines()[0][:80]}"
        print(f"{hd:8d} {bt:7d} {bn:7d} {warps:5d} {stages:6d} | {result}")


if __name__ == "__main__":
    main()
