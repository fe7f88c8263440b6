"""`--load-format dummy`: random weights of the real shapes, generated where the module lives.

Every tensor gets its own generator on its own device, seeded from (seed, name): a 31B on a GPU
fills in seconds without a host round trip, and the values do not depend on the parameter order.
"""

from __future__ import annotations

import zlib

import torch

MATRIX_STD = 0.02


def _is_multiplier(name: str) -> bool:
    """Whether `name` is a 1-D weight Gemma multiplies by, which belongs near 1.

    These are RMSNorm weights, layer_scalar and router scales.
    """
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("layer_scalar", "scale", "per_expert_scale") or name.endswith("norm.weight")


@torch.no_grad()
def init_dummy_weights(module: torch.nn.Module, seed: int = 0) -> None:
    """Fill every persistent parameter and buffer of `module` with finite random values.

    Matrices get N(0, 0.02), norms / scalars / scales uniform in [0.9, 1.1], 1-D integer buffers
    (the assistant's `token_ordering`) a random permutation. Non-persistent buffers (RoPE tables,
    embedding scales) are left as built.
    """
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights: fill once
            continue
        seen.add(id(tensor))
        if tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device: materialize the module before init_dummy_weights"
            )
        generator = torch.Generator(device=tensor.device)
        generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        if not tensor.is_floating_point():
            if tensor.dim() == 1:
                permutation = torch.randperm(
                    tensor.numel(), generator=generator, device=tensor.device
                )
                tensor.copy_(permutation.to(tensor.dtype))
            continue
        if tensor.dim() >= 2:
            tensor.normal_(0.0, MATRIX_STD, generator=generator)
        elif _is_multiplier(name):
            tensor.uniform_(0.9, 1.1, generator=generator)
        else:
            tensor.normal_(0.0, MATRIX_STD, generator=generator)
