"""FlashInfer's paged prefill kernels for the eager multi-token target steps
(`--attention-backend flashinfer`; `auto` never picks it).

Every step that fits a CUDA graph runs the Triton kernels, and by default every step does: the
mixed graphs cover prompt chunks up to the step budget. What is left to this backend are the eager
steps (`--enforce-eager`, say), whose sliding layers (head_dim 256) its prefill runs faster than
ours. Measured with `bench/bench_attention_backends.py` (docs/performance.md), FlashInfer 0.7.4 on
an H200:
- on a served mixed step (verifications beside prompt chunks) its sliding prefill is slower than
  our kernel, so it would lose inside the graphs even where it could be planned there;
- the full layers' head_dim 512 builds (FA2) but is slower than ours on prompts;
- decode, verification and the draft loop stay on Triton too: FlashInfer plans each step on the
  host from the keys' lengths, which graph replays under async scheduling do not have.
A head_dim whose kernel fails to build or run in the warm-up (no CUDA compiler, say) falls back to
Triton too, so the backend can never break serving.
"""

from __future__ import annotations

import logging

import torch

from gemma4serve.attention.metadata import AttentionMetadata, HostBatch
from gemma4serve.attention.triton_backend import TritonAttention

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
HEAD_DIMS = (64, 128, 256)  # the head dims it serves: FlashInfer's prefill measured faster there


class FlashInferAttention(TritonAttention):
    name = "flashinfer"

    def __init__(
        self,
        device: torch.device,
        layouts: dict,
        page_tokens: dict,
        head_dims: tuple[int, ...] = HEAD_DIMS,
    ):
        """layouts: kind -> (num_q_heads, num_kv_heads, head_dim) of the model's layer types;
        page_tokens: kind -> positions per KV page; head_dims: those FlashInfer may serve (a
        benchmark asks for more)."""
        import flashinfer

        self.page_tokens = page_tokens
        self.wrappers = {}  # kind -> a prefill wrapper, for kinds whose head_dim FlashInfer runs
        self.planned = {}  # kind -> the HostBatch the wrapper was last planned for
        for kind, (nh, nkv, hd) in layouts.items():
            if hd not in head_dims:
                continue
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD"
            )
            # build (JIT, once per machine) or load the kernel now, not in the middle of serving
            try:
                _warm_up(wrapper, device, nh, nkv, hd, page_tokens[kind])
            except Exception as error:  # noqa: BLE001 - any build or launch failure: Triton serves
                log.warning(
                    "FlashInfer prefill for %s layers (head_dim %d) unavailable, "
                    "Triton serves them: %s",
                    kind,
                    hd,
                    (str(error).splitlines() or [type(error).__name__])[0][:200],
                )
                continue
            self.wrappers[kind] = wrapper
        log.info(
            "attention: FlashInfer prefill for %s layers, Triton for the rest",
            ", ".join(sorted(self.wrappers)) or "no",
        )

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: str,
    ) -> torch.Tensor:
        wrapper = self.wrappers.get(kind)
        if wrapper is None or meta.host is None or meta.max_q_len == 1 or q.dtype != torch.bfloat16:
            return super().forward(q, k_cache, v_cache, meta, kind)
        if self.planned.get(kind) is not meta.host:  # once per step and kind, not per layer
            nh, nkv, hd = q.shape[1], k_cache.shape[2], q.shape[2]
            plan(wrapper, meta, kind, nh, nkv, hd, self.page_tokens[kind], q.dtype)
            self.planned[kind] = meta.host
        return wrapper.run(q, (k_cache, v_cache))


def paged_kv(
    host: HostBatch, kind: str, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV description of a step: (pages per group as offsets, the groups' pages
    in order, the used slots of each group's last page)."""
    pages = (host.kv_len + page_size - 1) // page_size
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    table = host.page_table[kind]
    indices = torch.cat([table[g, : int(n)] for g, n in enumerate(pages)])
    return indptr, indices, host.kv_len - (pages - 1) * page_size


def plan(
    wrapper,
    meta: AttentionMetadata,
    kind: str,
    nh: int,
    nkv: int,
    hd: int,
    page_size: int,
    dtype,
) -> None:
    """Plan a prefill wrapper for this step's layers of `kind` (host work, once per step)."""
    indptr, indices, last = paged_kv(meta.host, kind, page_size)
    window = meta.window[kind]
    # window: the visible keys ending at the query's position; FlashInfer counts those left of it
    wrapper.plan(
        meta.host.cu_seqlens_q,
        indptr,
        indices,
        last,
        nh,
        nkv,
        hd,
        page_size,
        causal=True,
        window_left=window - 1 if window else -1,
        sm_scale=1.0,
        q_data_type=dtype,
        kv_data_type=dtype,
    )


def _warm_up(wrapper, device, nh: int, nkv: int, hd: int, page_size: int) -> None:
    """Plan and run one small causal prefill of this shape (the JIT build happens here, once per
    machine)."""
    T = 2 * page_size
    cache = torch.zeros(3, page_size, nkv, hd, dtype=torch.bfloat16, device=device)
    host = HostBatch(
        cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
        kv_len=torch.tensor([T], dtype=torch.int32),
        page_table={"any": torch.tensor([[1, 2]], dtype=torch.int32)},
    )
    meta = AttentionMetadata(
        token_seq=None,
        kv_end=None,
        page_table=None,
        write_slot=None,
        window={"any": 0},
        cu_seqlens_q=None,
        max_q_len=T,
        host=host,
    )
    plan(wrapper, meta, "any", nh, nkv, hd, page_size, torch.bfloat16)
    wrapper.run(torch.zeros(T, nh, hd, dtype=torch.bfloat16, device=device), (cache, cache))
    torch.cuda.synchronize(device)
