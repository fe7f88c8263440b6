"""The Gemma 4 MTP assistant: a query-only 4-layer stack over the target's frozen KV.

It owns no KV (docs/gemma4.md §8, §12). Each step takes the target's scaled embedding of the token
at P and the previous hidden state, attends (queries at the constant position P) to the target's
last sliding and last full producer layer, and returns the draft token (the argmax of its logits)
plus the recurrent hidden state for the next step.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma4serve.config import AssistantConfig, TextConfig
from gemma4serve.model import fused
from gemma4serve.model.gemma4 import DecoderLayer, ForwardContext, Rotary, run_layers
from gemma4serve.model.layers import (
    REFERENCE_OPS,
    BestTokens,
    RMSNorm,
    TorchOps,
    bind_ops,
    embedding,
)
from gemma4serve.parallel.group import TensorParallel


class _Stack(nn.Module):
    def __init__(self, cfg: TextConfig, tp: TensorParallel | None):
        super().__init__()
        # Only the tied LM head; replicated under tensor parallelism (every rank drafts the same).
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, tp) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CentroidHead(nn.Module):
    """The E2B/E4B "ordered embedding" head: score 2048 token clusters, keep the top few, and give
    every other token a logit just below the worst selected one (HF fills min(selected) - 1)."""

    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        V, Ha = cfg.text.vocab_size, cfg.text.hidden_size
        self.top_k = cfg.centroid_top_k
        self.centroids = nn.Linear(Ha, cfg.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(V, dtype=torch.int64))

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The full logits [B, V]."""
        B, V = h.shape[0], lm_head.shape[0]
        toks, sel = self._selected(h, lm_head)
        fill = self._fill(sel.min(dim=-1, keepdim=True).values)
        return fill.expand(B, V).contiguous().scatter(1, toks, sel)

    def best_tokens(self, h: torch.Tensor, lm_head: torch.Tensor) -> BestTokens:
        """The first argmax of forward(h, lm_head) per row and its value, without the [B, V]
        logits: every other token's fill lies below the selected ones, so the first maximum is the
        lowest id among the selected tokens holding the largest value. Unless the fill rounds up
        to it (all selected equal): then every token ties and token 0 is the first."""
        toks, sel = self._selected(h, lm_head)
        tokens, best, least = self.ops.first_max(sel, ids=toks)
        every_token_ties = self._fill(least.to(sel.dtype)).float() == best
        return BestTokens(torch.where(every_token_ties, 0, tokens), best)

    @staticmethod
    def _fill(least: torch.Tensor) -> torch.Tensor:
        """Every unselected token's logit from the selected ones' smallest: HF's min(selected) - 1,
        in the logits' dtype."""
        return least - 1.0

    def _selected(self, h: torch.Tensor, lm_head: torch.Tensor):
        """(the top clusters' token ids [B, k * V / C], their logits [B, k * V / C])."""
        top = torch.topk(self.centroids(h), self.top_k, dim=-1).indices  # [B, k]
        clusters = self.token_ordering.view(self.centroids.out_features, -1)
        toks = clusters[top].reshape(h.shape[0], -1)  # canonical token ids
        return toks, (h[:, None, :] @ lm_head[toks].transpose(1, 2)).squeeze(1)


class Gemma4Assistant(nn.Module):
    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: AssistantConfig, tp: TensorParallel | None = None):
        """`tp`: the layers split as the target's (their queries read its KV shard)."""
        super().__init__()
        self.cfg = cfg
        Ha, Hb = cfg.text.hidden_size, cfg.backbone_hidden_size
        self.model = _Stack(cfg.text, tp)
        self.pre_projection = nn.Linear(2 * Hb, Ha, bias=False)
        self.post_projection = nn.Linear(Ha, Hb, bias=False)
        self.masked_embedding = CentroidHead(cfg) if cfg.use_ordered_embeddings else None
        # after bind(), with the fused ops, for a full (not centroid) head
        self.greedy_head: fused.GreedyHead | None = None
        self.rotary: Rotary | None = None
        self.optional_weights: set[str] = set()

    def bind(self, target_cfg: TextConfig, device) -> None:
        """Point the layers at the target's KV layers; choose the ops as Gemma4Model.bind does."""
        self.cfg.check_fits(target_cfg)
        ops = fused.select_ops(device)
        bind_ops(self, ops)
        self.rotary = Rotary(self.cfg.text, device, ops)
        for layer in self.model.layers:
            layer.self_attn.kv_layer = target_cfg.store_layer(layer.spec.kind)
            ops.prepare(layer)

    def finish_loading(self) -> None:
        """What needs the loaded weights: the greedy head of a full (not centroid) LM head."""
        if self.masked_embedding is None:  # drafts are the argmax of the raw logits
            self.greedy_head = self.ops.greedy_head(
                self.model.embed_tokens.weight, lambda logits: logits
            )

    @property
    def window(self) -> int:
        """Visible sliding rows: the last W_a + 1 committed ones (HF's inclusive bidirectional
        window)."""
        return self.cfg.text.sliding_window + 1

    def greedy_step(
        self, tok_embed: torch.Tensor, hprev: torch.Tensor, rope: dict, ctx: ForwardContext
    ):
        """One draft step for B sequences -> (draft tokens [B] int64, next hidden [B, Hb]).

        The tokens are the first argmax of the logits (through the greedy head where there is one).
        `rope`: the per-kind (cos, sin) at the sequences' position P, `self.rotary.cos_sin(P,
        dtype)`, the same for every step.
        """
        u = self.ops.linear(torch.cat([tok_embed, hprev], dim=-1), self.pre_projection.weight)
        _, h = run_layers(self.model.layers, u, rope, ctx, self.model.norm)
        if self.masked_embedding is not None:
            tokens = self.masked_embedding.best_tokens(h, self.model.embed_tokens.weight).tokens
        else:
            tokens = self.ops.best_tokens(self.greedy_head, h, self._logits).tokens
        return tokens, self.ops.linear(h, self.post_projection.weight)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The full (not centroid) head's logits."""
        return self.ops.linear(h, self.model.embed_tokens.weight)

    def checkpoint_param_name(self, name: str) -> str | None:
        return None if name == "lm_head.weight" else name
