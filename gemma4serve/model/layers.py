"""The building blocks of a Gemma 4 decoder layer and the torch reference of its ops.

The reference keeps HF 5.17's rounding points (docs/gemma4.md §2–5). `TorchOps` runs every op in
plain torch; `fused.FusedOps` runs the same ops as Triton kernels on CUDA. The model picks one in
`bind` and hands it to each module as `self.ops`; a module that was never bound (a test's
reference) runs `TorchOps`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gemma4serve.config import RopeSpec, TextConfig

if TYPE_CHECKING:
    from gemma4serve.model.gemma4 import Attention, DecoderLayer
    from gemma4serve_kernels import PeerBuffers


class BestTokens(NamedTuple):
    """Each row's first argmax of some logits, and the logit there."""

    tokens: torch.Tensor  # [T] int64
    values: torch.Tensor  # [T] fp32


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialised, as every weight is loaded: its random init (even on
    the meta device) imports torch._dynamo, seconds of every start."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm: fp32 inside, `pow(., -0.5)`, scale by w (not 1 + w), cast back."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """fp32 inverse frequencies; proportional RoPE zeroes the pairs past `rotated_pairs` (they pass
    through unrotated)."""
    hd = spec.head_dim
    exponents = torch.arange(0, 2 * spec.rotated_pairs, 2, dtype=torch.int64).float() / hd
    inv = 1.0 / (spec.theta**exponents)
    return torch.cat([inv, torch.zeros(hd // 2 - spec.rotated_pairs)])


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin at `positions` in fp32, rounded to the model dtype (docs/gemma4.md §4)."""
    theta = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([theta, theta], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation of x [T, heads, hd] with cos/sin [T, hd]; dim d pairs with
    d + hd/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store the new rows' K/V [T, nkv, hd] at their slots (page * page_tokens + offset) of the
    caches [num_pages, page_tokens, nkv, hd], whose pages lie at any stride. Every slot must be a
    real one (>= 0)."""
    page_tokens = k_cache.shape[1]
    pages, offsets = slots // page_tokens, slots % page_tokens
    k_cache[pages, offsets] = k
    v_cache[pages, offsets] = v


def moe_route(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int):
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): softmax over all experts
    in fp32, top-k, renormalised, times the learned per-expert scale (docs/gemma4.md §5)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights * per_expert_scale[experts], experts


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """Each token's k expert MLPs, weighted and summed in fp32, rounded once (HF grouped_mm)."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    # Sort the (token, slot) pairs by expert so each expert runs one GEMM over its tokens.
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0])
    xs = x[token_of]
    out = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(xs[rows], gate_up_proj[e]).chunk(2, dim=-1)
        out[rows] = F.linear(gelu_tanh(gate) * up, down_proj[e]).float()
        start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out
    per_slot = per_slot.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)
    return per_slot.sum(1).to(x.dtype)


class TorchOps:
    """The model's ops in plain torch: the reference, on any device.

    `fused.FusedOps` has the same methods with the same arguments. Methods that take a module read
    the weights that implementation needs from it.
    """

    def prepare(self, layer: DecoderLayer) -> None:
        """Lay out a decoder layer's weights for these ops: the reference reads each projection's
        own weight, so nothing changes."""

    def gemv_fits(self, x: torch.Tensor) -> bool:
        """Whether `linear` of x runs the streaming GEMV: never here."""
        return False

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, push: PeerBuffers | None = None
    ) -> torch.Tensor:
        """x @ weight^T, no bias. `push` (FusedOps only, where `gemv_fits(x)`): tensor-parallel
        peers the rows also go to, as the packets of the fused all-reduce that follows."""
        assert push is None, "the reference sends no rows"
        return F.linear(x, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        next_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x + rms_norm(h; weight)) * scale, and the next sublayer's norm of it (None without
        next_weight)."""
        x = x + rms_norm(h, weight, eps)
        if scale is not None:
            x = x * scale
        return x, (rms_norm(x, next_weight, eps) if next_weight is not None else None)

    def rope_cos_sin(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(inv_freq, positions, dtype)

    def norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """apply_rope(rms_norm(x; weight)): the per-head q/k norms and RoPE."""
        return apply_rope(rms_norm(x, weight, eps), cos, sin)

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
        """q [T, nh, hd] of a layer that writes K/V: q = RoPE(q_norm(q)), K = RoPE(k_norm(k)),
        V = v_norm(v) (the raw k on k_eq_v layers), and K/V stored in the caches at `slots`."""
        T, hd, eps = h.shape[0], attn.spec.head_dim, attn.eps
        q = F.linear(h, attn.q_proj.weight).view(T, -1, hd)
        q = apply_rope(rms_norm(q, attn.q_norm.weight, eps), cos, sin)
        raw_k = F.linear(h, attn.k_proj.weight).view(T, -1, hd)
        raw_v = raw_k if attn.v_proj is None else F.linear(h, attn.v_proj.weight).view(T, -1, hd)
        k = apply_rope(rms_norm(raw_k, attn.k_norm.weight, eps), cos, sin)
        v = rms_norm(raw_v, None, eps)  # v_norm: no learned scale, no rotation
        write_kv(k_cache, v_cache, k, v, slots)
        return q

    def gelu_mlp(self, mlp: MLP, x: torch.Tensor, push: PeerBuffers | None = None) -> torch.Tensor:
        """down(gelu_tanh(gate(x)) * up(x)); `push` as linear's, for down."""
        assert push is None, "the reference sends no rows"
        return mlp.down_proj(gelu_tanh(mlp.gate_proj(x)) * mlp.up_proj(x))

    def gelu_linear_times(
        self, x: torch.Tensor, weight: torch.Tensor, times: torch.Tensor
    ) -> torch.Tensor:
        """gelu_tanh(x @ weight^T) * times (PLE's gate on the per-layer input)."""
        return gelu_tanh(F.linear(x, weight)) * times

    def moe_route(self, logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int):
        return moe_route(logits, per_expert_scale, top_k)

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts(x, gate_up_proj, down_proj, weights, experts)

    def greedy_head(self, weight: torch.Tensor, softcap):
        """A head that finds greedy tokens without the full logits, or None (the reference has
        none)."""
        return None

    def best_tokens(self, head, hidden: torch.Tensor, logits) -> BestTokens:
        """Each row's first argmax of logits(hidden) and its value."""
        values, tokens = logits(hidden).max(-1)
        return BestTokens(tokens, values.float())

    def first_max(self, values: torch.Tensor, ids: torch.Tensor | None = None):
        """Per row of values [M, N]: the lowest id holding its largest value (from ids [M, N], or
        the column index), that value and the row's smallest value, both as fp32. NaN is the
        largest value (torch's argmax rule), so a row holding one gives its first NaN's id."""
        best = values.max(-1, keepdim=True).values  # NaN where the row holds one
        if ids is None:
            ids = torch.arange(values.shape[-1], device=values.device).expand_as(values)
        hit = torch.where(best.isnan(), values.isnan(), values == best)
        tokens = torch.where(hit, ids, torch.iinfo(torch.int64).max).min(-1).values
        return tokens, best.squeeze(-1).float(), values.min(-1).values.float()


REFERENCE_OPS = TorchOps()


def bind_ops(model: nn.Module, ops: TorchOps) -> None:
    """Hand `ops` to every submodule of `model` that runs ops (those with an `ops` attribute)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def concat_weights(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several projections of the same input (one GEMM instead of several).

    The original parameters become views into it, so names and the state dict are unchanged and no
    memory is duplicated.
    """
    fused = torch.cat([linear.weight for linear in linears], dim=0)
    start = 0
    for linear in linears:
        n = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused


class RMSNorm(nn.Module):
    ops: TorchOps = REFERENCE_OPS

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    ops: TorchOps = REFERENCE_OPS

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # [gate; up] as one weight, after fuse()

    def fuse(self) -> None:
        self.gate_up = concat_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, push: PeerBuffers | None = None) -> torch.Tensor:
        return self.ops.gelu_mlp(self, x, push)


class Router(nn.Module):
    """Top-k experts per token and their weights (docs/gemma4.md §5)."""

    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.ops.rms_norm(residual, None, self.eps) * self.scale * self.root_size
        return self.ops.moe_route(self.proj(z), self.per_expert_scale, self.top_k)


class Experts(nn.Module):
    """The expert MLPs; each token's k weighted outputs are summed in fp32 and rounded once."""

    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: TextConfig):
        super().__init__()
        num_experts, width, hidden = (
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.hidden_size,
        )
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        return self.ops.moe_experts(x, self.gate_up_proj, self.down_proj, weights, experts)
