"""`--load-format dummy`: random weights of the real shapes, generated where the module lives.

Every tensor gets its own generator on its own device, seeded from (seed, name): a 31B on a GPU fills in
seconds without a host round trip, and the values do not depend on the order of the parameters.
"""

from __future__ import annotations

import zlib

import torch

MATRIX_STD = 0.02


def _is_multiplier(name: str) -> bool:
    """1-D weights Gemma multiplies by (RMSNorm weights, layer_scalar, router scales): they belong near 1."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("layer_scalar", "scale", "per_expert_scale") or name.endswith("norm.weight")


@torch.no_grad()
def init_dummy_weights(module: torch.nn.Module, seed: int = 0) -> None:
    """Fill every persistent parameter and buffer of `module` with finite random values: matrices N(0, 0.02),
    norms / scalars / scales uniform in [0.9, 1.1], 1-D integer buffers (the assistant's `token_ordering`) a
    random permutation. Non-persistent buffers (RoPE tables, embedding scales) are left as built."""
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied weights: fill once
            continue
        seen.add(id(t))
        if t.is_meta:
            raise ValueError(
                f"{name} is on the meta device: materialize the module before init_dummy_weights"
            )
        g = torch.Generator(device=t.device)
        g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        if not t.is_floating_point():
            if t.dim() == 1:
                t.copy_(torch.randperm(t.numel(), generator=g, device=t.device).to(t.dtype))
            continue
        if t.dim() >= 2:
            t.normal_(0.0, MATRIX_STD, generator=g)
        elif _is_multiplier(name):
            t.uniform_(0.9, 1.1, generator=g)
        else:
            t.normal_(0.0, MATRIX_STD, generator=g)
