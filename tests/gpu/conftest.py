"""GPU-only tests (bf16 at the real shapes, CUDA graphs); everything here skips without CUDA.

Run on a CUDA machine with:  pytest tests/gpu -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(skip)
