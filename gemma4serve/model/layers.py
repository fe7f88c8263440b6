"""The building blocks of a Gemma 4 decoder layer, with HF 5.17's rounding points (spec §2–5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemma4serve.config import RopeSpec, TextConfig
from gemma4serve.model import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm: fp32 inside, `pow(., -0.5)`, scale by w (not 1 + w), cast back."""
    if (k := fused.on(x)) is not None:
        return k.rms_norm(x, weight, eps)
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up = fused.concat_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and fused.on(x) is not None:
            return fused.gelu_mlp(x, self.gate_up, self.down_proj.weight)
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over all experts in fp32, top-k, renormalise, times the learned per-expert scale (spec §5)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = rms_norm(residual, None, self.eps) * self.scale * self.root_size
        if (k := fused.on(z)) is not None:  # softmax, top-k, renormalise and scale in one launch
            weights, experts = k.moe_route(self.proj(z), self.per_expert_scale, self.top_k)
            return weights, experts
        probs = torch.softmax(self.proj(z), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """Expert GEMMs with each token's k weighted outputs summed in fp32 and rounded once (HF grouped_mm)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        if (k := fused.on(x)) is not None:  # grouped expert GEMMs, no host sync
            return k.moe_experts(x, self.gate_up_proj, self.down_proj, weights, experts)
        T, K = experts.shape
        flat = experts.reshape(-1)
        # Sort the (token, slot) pairs by expert so each expert runs one GEMM over its tokens.
        order = torch.argsort(flat, stable=True)
        token_of = order // K
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        xs = x[token_of]
        out = torch.empty(T * K, x.shape[-1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(
            counts.tolist()
        ):  # reference path; the GPU path uses a grouped kernel
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(gelu_tanh(gate) * up, self.down_proj[e]).float()
            start += n
        per_slot = torch.empty_like(out)
        per_slot[order] = out
        per_slot = per_slot.view(T, K, -1) * weights.unsqueeze(-1)
        return per_slot.sum(1).to(x.dtype)


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """fp32 inverse frequencies; proportional RoPE zeroes the pairs past `rotated_pairs` (they pass through)."""
    hd = spec.head_dim
    inv = 1.0 / (
        spec.theta ** (torch.arange(0, 2 * spec.rotated_pairs, 2, dtype=torch.int64).float() / hd)
    )
    return torch.cat([inv, torch.zeros(hd // 2 - spec.rotated_pairs)])


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin at `positions` in fp32, rounded to the model dtype (spec §4)."""
    if (k := fused.on(positions)) is not None and positions.is_contiguous():
        return k.rope_tables(inv_freq, positions, dtype)  # one launch instead of seven
    theta = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([theta, theta], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
):
    """apply_rope(rms_norm(x; weight)) for the per-head q/k norms, one launch on CUDA."""
    if (k := fused.on(x)) is not None:
        return k.rmsnorm_rope(x, weight, cos, sin, eps)
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation of x [T, heads, hd] with cos/sin [T, hd]; dim d pairs with d + hd/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
