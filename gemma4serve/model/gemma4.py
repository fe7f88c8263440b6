"""The Gemma 4 text decoder (every released variant) over the paged KV cache (docs/gemma4.md §3).

Module names mirror the HF checkpoint so loading is a prefix strip. The model writes each producer
layer's new K/V into the pages named by the batch and attends through the backend; it keeps no state
of its own. `bind` picks the ops (fused kernels on CUDA, else the torch reference) once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from gemma4serve.attention.metadata import AttentionMetadata, Readout
from gemma4serve.config import LayerSpec, TextConfig
from gemma4serve.kv.cache import KVCache
from gemma4serve.model import fused
from gemma4serve.model.layers import (
    MLP,
    REFERENCE_OPS,
    Experts,
    RMSNorm,
    Router,
    TorchOps,
    bind_ops,
    concat_weights,
    embedding,
    rope_inv_freq,
)
from gemma4serve.parallel.group import (
    TensorParallel,
    vocab_parallel_argmax,
    vocab_parallel_logits,
    vocab_parallel_lookup,
)

if TYPE_CHECKING:
    from gemma4serve_kernels import PeerBuffers


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv: KVCache
    attn: object  # an attention backend: .forward(q, k_cache, v_cache, meta, kind)
    readout: Readout | None = None  # the rows read after the pass (None: every row)


@dataclass
class ReadRows:
    """A pass's read-out rows (padding clamped into the pass) and the context of attention
    restricted to them: what the layers from the last K/V write on run over."""

    rows: torch.Tensor  # [R] int64
    ctx: ForwardContext


class Attention(nn.Module):
    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: TextConfig, spec: LayerSpec, hidden_size: int):
        super().__init__()
        self.spec = spec
        self.kv_layer = spec.kv_layer  # the assistant rebinds this to the target's store layer
        self.eps = cfg.rms_norm_eps
        nh, hd, nkv = cfg.num_heads, spec.head_dim, spec.num_kv_heads
        self.q_proj = nn.Linear(hidden_size, nh * hd, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if not spec.kv_shared:
            self.k_proj = nn.Linear(hidden_size, nkv * hd, bias=False)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.v_proj = None if spec.k_eq_v else nn.Linear(hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, hidden_size, bias=False)
        self.qkv: torch.Tensor | None = None  # [q; k (; v)] as one weight, after fuse()

    def fuse(self) -> None:
        if not self.spec.kv_shared:
            projections = (self.q_proj, self.k_proj, self.v_proj)
            self.qkv = concat_weights(*(p for p in projections if p is not None))

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        push: PeerBuffers | None = None,
        read: ReadRows | None = None,
    ) -> torch.Tensor:
        """`push`: o_proj's rows also go to these tensor-parallel peers (`ops.linear`). `read`:
        K/V are written for every row of h, the queries onward run on these rows only."""
        T, hd, kind = h.shape[0], self.spec.head_dim, self.spec.kind
        k_cache, v_cache = ctx.kv.layer(self.kv_layer)
        if self.spec.kv_shared:  # reads the K/V of an earlier layer: queries only
            q = self.ops.linear(h, self.q_proj.weight).view(T, -1, hd)
            q = self.ops.norm_rope(q, self.q_norm.weight, self.eps, cos, sin)
        else:
            slots = ctx.meta.write_slot[kind]
            q = self.ops.project_qkv(self, h, cos, sin, k_cache, v_cache, slots)
        if read is not None:
            q, ctx = q[read.rows], read.ctx
        out = ctx.attn.forward(q, k_cache, v_cache, ctx.meta, kind)
        # Under tensor parallelism o_proj is row-parallel: this rank's partial sum (the layer
        # all-reduces it in its norm).
        return self.ops.linear(out.reshape(q.shape[0], -1), self.o_proj.weight, push)


class DecoderLayer(nn.Module):
    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: TextConfig, spec: LayerSpec, tp: TensorParallel | None = None):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.spec = spec
        self.tp = tp  # o_proj, down_proj and the experts' down are row-parallel: all-reduced
        self.self_attn = Attention(cfg, spec, H)
        self.mlp = MLP(H, spec.mlp_width)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = cfg.moe
        if cfg.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.ple = cfg.ple_dim > 0
        if self.ple:
            self.per_layer_input_gate = nn.Linear(H, cfg.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.ple_dim, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def _add_norm(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        norm: RMSNorm,
        scale: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
        partial: bool = False,
        pushed: bool = False,
    ):
        """(x + norm(h)) * scale, and next_norm of that (None without next_norm). `partial`: h is
        this rank's share of a row-parallel sum under tensor parallelism, all-reduced first
        (`pushed`: its GEMV sent it to the peers already)."""
        next_weight = next_norm.weight if next_norm is not None else None
        if partial and self.tp is not None:
            return self.tp.reduce_add_norm(
                self.ops, x, h, norm.weight, norm.eps, scale, next_weight, pushed
            )
        return self.ops.add_norm(x, h, norm.weight, norm.eps, scale, next_weight)

    def forward(
        self,
        x,
        cos,
        sin,
        ctx: ForwardContext,
        ple: torch.Tensor | None,
        normed: torch.Tensor | None,
        next_norm: RMSNorm,
        read: ReadRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (x after the layer, next_norm of it). `normed`: this layer's input norm of x, when
        the previous layer already computed it. `read`: the layer writes K/V for every row of x
        and returns only these rows (its queries, attention and MLP run on them alone)."""
        normed = normed if normed is not None else self.input_layernorm(x)
        if read is not None:
            x = x[read.rows]
            ple = ple[read.rows] if ple is not None else None
        # Under tensor parallelism the row-parallel GEMVs send their rows to the peers themselves
        # where the fused all-reduce takes them.
        push = self.tp.rows_to_push(self.ops, x) if self.tp is not None else None
        h = self.self_attn(normed, cos, sin, ctx, push, read)
        x, h_ff = self._add_norm(
            x,
            h,
            self.post_attention_layernorm,
            next_norm=self.pre_feedforward_layernorm,
            partial=True,
            pushed=push is not None,
        )
        residual = x
        if self.moe:
            push = None  # the MLP's and the experts' sums are all-reduced together
        h = self.mlp(h_ff, push)
        if self.moe:
            weights, experts = self.router(residual)
            moe_out = self.experts(self.pre_feedforward_layernorm_2(residual), weights, experts)
            if self.tp is not None:  # both partial sums in one all-reduce
                h, moe_out = self.tp.all_reduce(torch.stack([h, moe_out])).unbind(0)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe_out)
        partial, pushed = not self.moe, push is not None  # the MoE sum was all-reduced above
        # layer_scalar scales the whole residual stream, after PLE when there is one
        if not self.ple:
            return self._add_norm(
                residual,
                h,
                self.post_feedforward_layernorm,
                self.layer_scalar,
                next_norm,
                partial,
                pushed,
            )
        x, _ = self._add_norm(
            residual, h, self.post_feedforward_layernorm, partial=partial, pushed=pushed
        )
        gate = self.ops.gelu_linear_times(x, self.per_layer_input_gate.weight, ple)
        return self._add_norm(
            x,
            self.ops.linear(gate, self.per_layer_projection.weight),
            self.post_per_layer_input_norm,
            self.layer_scalar,
            next_norm,
        )


def run_layers(
    layers, x, rope: dict, ctx: ForwardContext, final_norm: RMSNorm, ple=None, normed=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder stack -> (x after it, final_norm of x); each layer also produces the next one's
    normed input (`normed`: the first one's, when already computed)."""
    for i, layer in enumerate(layers):
        cos, sin = rope[layer.spec.kind]
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        x, normed = layer(x, cos, sin, ctx, ple[:, i] if ple is not None else None, normed, nxt)
    return x, normed


class Rotary:
    """RoPE tables per layer type. The fp32 inverse frequencies stay out of the state dict, so a
    bf16 cast never touches them."""

    def __init__(self, cfg: TextConfig, device, ops: TorchOps):
        self.ops = ops
        self.inv_freq = {kind: rope_inv_freq(spec).to(device) for kind, spec in cfg.rope.items()}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """kind -> (cos, sin) [T, head_dim] at `positions`, in `dtype`."""
        return {
            kind: self.ops.rope_cos_sin(inv, positions, dtype)
            for kind, inv in self.inv_freq.items()
        }


_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
_SHARED_KV_PARAM = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")


class Gemma4Model(nn.Module):
    """Target decoder: `forward` returns the final-normed hidden states, `logits` applies the tied
    head."""

    ops: TorchOps = REFERENCE_OPS

    def __init__(self, cfg: TextConfig, tp: TensorParallel | None = None):
        """`cfg`: this rank's shard of the config under tensor parallelism (`tp`), whose
        embedding tables hold this rank's share of the vocabulary rows."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        H, shards = cfg.hidden_size, tp.size if tp is not None else 1
        self.embed_tokens = embedding(cfg.vocab_size // shards, H)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, tp) for spec in cfg.layers)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.ple_dim:
            L, D = cfg.num_layers, cfg.ple_dim
            self.embed_tokens_per_layer = embedding(cfg.ple_vocab_size // shards, L * D)
            self.per_layer_model_projection = nn.Linear(H, L * D, bias=False)
            self.per_layer_projection_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary: Rotary | None = None
        self.greedy_head: fused.GreedyHead | None = None  # after bind(), with the fused ops (bf16)
        self.optional_weights: set[str] = set()

    def bind(self, device) -> None:
        """Choose the ops for `device`, where the weights live (fused kernels on CUDA, else the
        torch reference), and set up what is not a weight: RoPE tables and the weight layout those
        ops read. Called before the weights are loaded, so they load straight into that layout."""
        ops = fused.select_ops(device)
        bind_ops(self, ops)
        self.rotary = Rotary(self.cfg, device, ops)
        for layer in self.layers:
            ops.prepare(layer)

    def finish_loading(self) -> None:
        """What needs the loaded weights: the greedy head's int8 copy of the LM head (of this
        rank's vocabulary shard under tensor parallelism)."""
        self.greedy_head = self.ops.greedy_head(self.embed_tokens.weight, self.softcap)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The scaled embedding E[ids] * dtype(sqrt(H)); the drafter embeds its tokens with it
        too."""
        w = self.embed_tokens.weight
        scale = torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(w.dtype)
        if self.tp is not None:
            return vocab_parallel_lookup(self.tp, w, ids, self.cfg.vocab_size, scale)
        return w[ids] * scale

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T, L, D = ids.shape[0], cfg.num_layers, cfg.ple_dim
        w = self.embed_tokens_per_layer.weight
        scale = torch.tensor(D**0.5, dtype=torch.float32).to(w.dtype)
        if self.tp is None:
            tok = (w[ids] * scale).view(T, L, D)
        else:
            tok = vocab_parallel_lookup(self.tp, w, ids, cfg.ple_vocab_size, scale).view(T, L, D)
        proj = (self.per_layer_model_projection(x) * cfg.hidden_size**-0.5).view(T, L, D)
        proj = self.per_layer_projection_norm(proj)
        return (proj + tok) * 2.0**-0.5

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H]. With `ctx.readout`, what follows the last K/V write
        runs on its rows only, and the other rows of the result are unspecified."""
        x = self.embed(ids)
        ple = self.per_layer_inputs(ids, x) if self.cfg.ple_dim else None
        rope = self.rotary.cos_sin(positions, x.dtype)
        if ctx.readout is None:
            return run_layers(self.layers, x, rope, ctx, self.norm, ple)[1]
        # Rows nobody reads are needed only for the K/V they leave: they stop at the last layer
        # that writes K/V, after its fused Q/K/V projection (docs/gemma4.md §3.6).
        last = self.cfg.first_shared - 1
        writer, after = self.layers[last], self.layers[last + 1 :]
        x, normed = run_layers(
            self.layers[:last],
            x,
            rope,
            ctx,
            writer.input_layernorm,
            ple[:, :last] if ple is not None else None,
        )
        T, readout = x.shape[0], ctx.readout
        writer_args = (
            *rope[writer.spec.kind],
            ctx,
            ple[:, last] if ple is not None else None,
            normed,
            after[0].input_layernorm if after else self.norm,
        )
        if readout.rows.shape[0] == 0:  # a step that only prefills: the writer runs whole
            return writer(x, *writer_args)[1]
        rows = readout.rows.clamp(max=T - 1)  # padding entries run on some row; dropped below
        read = ReadRows(rows, ForwardContext(readout.metadata(ctx.meta, rows), ctx.kv, ctx.attn))
        x, normed = writer(x, *writer_args, read)
        _, hidden = run_layers(
            after,
            x,
            {kind: (cos[rows], sin[rows]) for kind, (cos, sin) in rope.items()},
            read.ctx,
            self.norm,
            ple[rows, last + 1 :] if ple is not None else None,
            normed,
        )
        out = hidden.new_empty(T + 1, hidden.shape[1])  # row T takes the padding entries
        return out.index_copy_(0, readout.rows, hidden)[:T]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tied LM head and the final softcap, both in the model dtype (three bf16 roundings in the
        cap), written into `out` where given. Under tensor parallelism every rank gets the whole
        [T, V]."""
        if self.tp is None:
            return self.shard_logits(hidden, out)
        return vocab_parallel_logits(self.tp, self.shard_logits(hidden), out)

    def shard_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of this rank's vocabulary shard (all of them on one device)."""
        return self.softcap(self.ops.linear(hidden, self.embed_tokens.weight), out)

    def softcap(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        cap = self.cfg.final_logit_softcapping
        if not cap:
            return logits if out is None else out.copy_(logits)
        return torch.mul(torch.tanh(logits / cap), cap, out=out)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first argmax of logits(hidden) per row, [T] int64. Few rows take the greedy head
        where there is one: it reads most of the head as int8 and gets the same tokens. Under
        tensor parallelism each rank finds its shard's best, and one all-reduce picks."""
        best = self.ops.best_tokens(self.greedy_head, hidden, self.shard_logits)
        if self.tp is None:
            return best.tokens
        return vocab_parallel_argmax(self.tp, best, self.cfg.vocab_size)

    def checkpoint_param_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> our parameter name, or None to skip it."""
        if name.startswith(_TOWERS) or name == "lm_head.weight":
            return None
        for prefix in ("model.language_model.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        match = _SHARED_KV_PARAM.match(name)
        if match and self.cfg.layers[int(match.group(1))].kv_shared:
            return None  # dead k/v weights some E2B/E4B checkpoints carry on KV-shared layers
        return name
