"""What each rank holds: its config (heads, KV heads, MLP and expert widths divided) and the slice
of every checkpoint tensor that fills it.

Attention is split by KV head (a rank's query heads are those that read its KV heads), so a rank's
KV pages hold only its heads; MLPs and experts are split column-wise (gate/up) and row-wise
(down, o_proj), and the target's embedding tables by vocabulary rows. Everything else is
replicated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from gemma4serve.config import AssistantConfig, ConfigError, TextConfig
from gemma4serve.parallel.group import TensorParallel


def _divide(what: str, n: int, size: int) -> int:
    if n % size:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide {what} ({n})")
    return n // size


def _kv_heads(num_kv_heads: int, size: int) -> int:
    if num_kv_heads < size and size % num_kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {size} must divide or be a multiple of the KV heads "
            f"({num_kv_heads})"
        )
    return max(1, num_kv_heads // size)


def shard_text_config(cfg: TextConfig, size: int) -> TextConfig:
    """The config of one rank's shard: per-rank heads, KV heads and MLP/expert widths. The
    vocabulary and hidden size stay whole (samplers and masks see the whole vocabulary)."""
    _divide("the vocabulary", cfg.vocab_size, size)
    if cfg.ple_dim:
        _divide("the per-layer-input vocabulary", cfg.ple_vocab_size, size)
    heads = _divide("num_attention_heads", cfg.num_heads, size)
    layers = []
    for layer in cfg.layers:
        kv = _kv_heads(layer.num_kv_heads, size)
        if layer.num_kv_heads >= size:
            _divide("num_key_value_heads", layer.num_kv_heads, size)
        layers.append(
            dataclasses.replace(
                layer,
                num_kv_heads=kv,
                mlp_width=_divide("intermediate_size", layer.mlp_width, size),
            )
        )
    return dataclasses.replace(
        cfg,
        num_heads=heads,
        num_kv_heads=_kv_heads(cfg.num_kv_heads, size),
        num_global_kv_heads=(
            _kv_heads(cfg.num_global_kv_heads, size) if cfg.num_global_kv_heads else None
        ),
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=(
            _divide("moe_intermediate_size", cfg.moe_intermediate_size, size) if cfg.moe else 0
        ),
        layers=tuple(layers),
    )


def shard_assistant_config(cfg: AssistantConfig, size: int) -> AssistantConfig:
    """The drafter reads the target's KV shard, so its attention splits the same way."""
    return dataclasses.replace(cfg, text=shard_text_config(cfg.text, size))


@dataclass(frozen=True)
class Shard:
    """A rank's part of a checkpoint tensor: these [start, end) ranges of `dim`, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)$")


def checkpoint_shard(
    param: str,
    shape: tuple[int, ...],
    cfg: TextConfig,
    tp: TensorParallel,
    *,
    vocab_parallel: bool,
) -> Shard | None:
    """The slice of the full-shape checkpoint tensor `param` (our parameter name) that rank
    `tp.rank` loads, or None for a replicated tensor. `cfg` is the whole (unsharded) config;
    `vocab_parallel`: the embedding tables are split by vocabulary rows (the target's, not the
    drafter's LM head)."""
    r, n = tp.rank, tp.size

    def even(dim: int) -> Shard:
        step = shape[dim] // n
        return Shard(dim, ((r * step, (r + 1) * step),))

    if vocab_parallel and param in ("embed_tokens.weight", "embed_tokens_per_layer.weight"):
        return even(0)
    match = _LAYER.match(param)
    if match is None:
        return None
    spec, leaf = cfg.layers[int(match.group(1))], match.group(2)
    if leaf == "self_attn.q_proj.weight":
        return even(0)
    if leaf in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        first, count = tp.kv_head_block(spec.num_kv_heads)
        hd = spec.head_dim
        return Shard(0, ((first * hd, (first + count) * hd),))
    if leaf in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        return even(1)
    if leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return even(0)
    if leaf == "experts.gate_up_proj":  # [E, gate; up, H]: this rank's rows of each half
        half = shape[1] // 2
        step = half // n
        return Shard(1, ((r * step, (r + 1) * step), (half + r * step, half + (r + 1) * step)))
    if leaf == "experts.down_proj":  # [E, H, width]
        return even(2)
    return None
