"""The model's ops as the Triton kernels of gemma4serve_kernels (CUDA), and the choice of ops.

`select_ops(device)` picks, once per model in `bind`, `FusedOps` where the kernels run and the torch
reference `TorchOps` (layers.py) elsewhere. The kernels keep the reference's rounding points.

Switches, for comparisons:
- GEMMA4SERVE_DISABLE_FUSED=1: the reference ops on CUDA too.
- GEMMA4SERVE_GEMV_MAX_ROWS=0: every projection goes to cuBLAS.
- GEMMA4SERVE_DISABLE_PDL=1: kernels launch without programmatic dependent launch.
- GEMMA4SERVE_DISABLE_GREEDY_HEAD=1: greedy tokens come from the full logits (and the head's int8
  copy is not made).
"""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gemma4serve.model.layers import MLP, BestTokens, TorchOps

if TYPE_CHECKING:
    from gemma4serve.model.gemma4 import Attention, DecoderLayer
    from gemma4serve_kernels import PeerBuffers

# Rows up to which `linear` uses the GEMV kernel (capped by its row tile).
GEMV_MAX_ROWS = int(os.environ.get("GEMMA4SERVE_GEMV_MAX_ROWS", "16"))


@cache
def kernels():
    """The gemma4serve_kernels module, or None where it cannot run (no CUDA, switched off)."""
    if os.environ.get("GEMMA4SERVE_DISABLE_FUSED") == "1" or not torch.cuda.is_available():
        return None
    try:
        import gemma4serve_kernels
    except ImportError:
        return None
    return gemma4serve_kernels


def on(x: torch.Tensor):
    """The kernel module if x lives where the kernels run, else None (for callers outside the
    model, which has its ops chosen in bind)."""
    return kernels() if x.is_cuda else None


def gemv_max_rows() -> int:
    """Rows up to which few-row inputs take the GEMV (and the greedy head)."""
    return min(GEMV_MAX_ROWS, kernels().GEMV_MAX_ROWS)


def select_ops(device) -> TorchOps:
    """FusedOps on a CUDA device where the kernels load, else the reference TorchOps."""
    if torch.device(device).type == "cuda" and kernels() is not None:
        return FusedOps()
    return TorchOps()


class GreedyHead:
    """Greedy tokens of a bf16 LM head and its softcap for few-row inputs, exactly the argmax of the
    full logits, reading the head mostly as an int8 copy (kernels/greedy_head.py). The copy costs
    half the head's memory. Its `table` (the softcap at every bf16 value) and the table's `floor`
    also serve FusedOps.best_tokens past those rows."""

    def __init__(self, weight: torch.Tensor, softcap):
        self.kernels = kernels()
        self.weight = weight
        self.q, self.scale = self.kernels.quantize_rows(weight)
        self.table = self.kernels.value_table(softcap, weight.device)
        self.floor = self.kernels.floor_table(self.table)

    def __call__(self, hidden: torch.Tensor) -> BestTokens:
        return BestTokens(
            *self.kernels.greedy_head(hidden, self.weight, self.q, self.scale, self.table)
        )


class FusedOps(TorchOps):
    """The model's ops as Triton kernels on CUDA, with TorchOps's methods and rounding points.

    Few-row projections (decode, verify, the draft loop) take the streaming GEMV, so a step stays a
    chain of Triton kernels that overlap through PDL; larger ones go to cuBLAS.
    """

    def __init__(self):
        self.kernels = kernels()
        self.gemv_rows = gemv_max_rows()

    def prepare(self, layer: DecoderLayer) -> None:
        """Concatenate the layer's q/k/v and gate/up weights (one GEMM each)."""
        layer.fuse()

    def gemv_fits(self, x: torch.Tensor) -> bool:
        """A 2-D input of few enough rows for the GEMV's row tile, unit stride along K."""
        return x.dim() == 2 and x.shape[0] <= self.gemv_rows and x.stride(1) == 1

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, push: PeerBuffers | None = None
    ) -> torch.Tensor:
        if self.gemv_fits(x):
            return self.kernels.gemv(x, weight, push=push)
        assert push is None, "only the GEMV sends rows"
        return F.linear(x, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def add_norm(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        next_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if next_weight is None:
            return self.kernels.rmsnorm_residual_add(x, h, weight, eps, scale), None
        return self.kernels.rmsnorm_residual_add(x, h, weight, eps, scale, next_weight)

    def rope_cos_sin(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        if positions.is_contiguous():  # one launch instead of seven
            return self.kernels.rope_tables(inv_freq, positions, dtype)
        return super().rope_cos_sin(inv_freq, positions, dtype)

    def norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        return self.kernels.rmsnorm_rope(x, weight, cos, sin, eps)

    def project_qkv(
        self,
        attn: Attention,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One GEMM over the concatenated weight, then norms, RoPE and the K/V write in one
        launch."""
        return self.kernels.qkv_epilogue(
            self.linear(h, attn.qkv),
            attn.q_norm.weight,
            attn.k_norm.weight,
            cos,
            sin,
            attn.eps,
            k_cache,
            v_cache,
            slots,
            attn.q_proj.weight.shape[0] // attn.spec.head_dim,
            attn.spec.num_kv_heads,
            attn.spec.k_eq_v,
        )

    def gelu_mlp(self, mlp: MLP, x: torch.Tensor, push: PeerBuffers | None = None) -> torch.Tensor:
        """Few rows: gemv_mlp (the GEMV with the GELU·up epilogue, no [T, 2I] intermediate, then
        down). Else the GEMM, the activation kernel and the down GEMM."""
        if self.gemv_fits(x):
            return self.kernels.gemv_mlp(x, mlp.gate_up, mlp.down_proj.weight, push=push)
        assert push is None, "only the GEMV sends rows"
        return F.linear(self.kernels.gelu_tanh_mul(F.linear(x, mlp.gate_up)), mlp.down_proj.weight)

    def gelu_linear_times(
        self, x: torch.Tensor, weight: torch.Tensor, times: torch.Tensor
    ) -> torch.Tensor:
        """Few rows: the GEMV with GELU·times in its epilogue. Else the GEMM and one activation
        launch."""
        if self.gemv_fits(x):
            return self.kernels.gemv(x, weight, gelu_times=times)
        return self.kernels.gelu_tanh_times(F.linear(x, weight), times)

    def moe_route(self, logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int):
        return self.kernels.moe_route(logits, per_expert_scale, top_k)

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
    ) -> torch.Tensor:
        """Grouped expert GEMMs, no host sync."""
        return self.kernels.moe_experts(x, gate_up_proj, down_proj, weights, experts)

    def greedy_head(self, weight: torch.Tensor, softcap) -> GreedyHead | None:
        """The greedy head of a bf16 LM head, unless GEMMA4SERVE_DISABLE_GREEDY_HEAD=1."""
        if (
            weight.dtype != torch.bfloat16
            or os.environ.get("GEMMA4SERVE_DISABLE_GREEDY_HEAD") == "1"
        ):
            return None
        return GreedyHead(weight, softcap)

    def best_tokens(self, head, hidden: torch.Tensor, logits) -> BestTokens:
        """Through the greedy head where it takes these rows; more rows read the head's bf16 logits
        once, the softcap read from its table at each chunk's largest logit (the same tokens and
        values)."""
        if head is None:
            return super().best_tokens(head, hidden, logits)
        if self.gemv_fits(hidden):
            return head(hidden)
        tokens, values, _ = self.kernels.first_max(
            self.linear(hidden, head.weight), table=head.table, floor=head.floor
        )
        return BestTokens(tokens, values)

    def first_max(self, values: torch.Tensor, ids: torch.Tensor | None = None):
        return self.kernels.first_max(values, ids=ids)
