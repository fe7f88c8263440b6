"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton picks interpreter or compiled mode when the kernels are first imported: without a GPU,
# every test that touches them must see the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tiny models are far too small for intra-op threads to pay; with two cores they only contend.
# The environment variable gives the servers and engine processes the tests start one thread too.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


class TinyCheckpoints:
    """Each tiny checkpoint (gemma4serve.demo.checkpoints), built once per session on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[tuple, Path] = {}

    def get(self, variant: str, release_format: bool = True, shards: int = 1) -> Path:
        from gemma4serve.demo.checkpoints import write_tiny_checkpoint

        key = ("target", variant, release_format, shards)
        if key not in self._built:
            name = f"{variant}-{'release' if release_format else 'text'}-{shards}shard"
            self._built[key] = write_tiny_checkpoint(
                self.root / name, variant, release_format=release_format, shards=shards
            )
        return self._built[key]

    def get_assistant(self, variant: str) -> Path:
        from gemma4serve.demo.checkpoints import write_tiny_assistant

        key = ("assistant", variant)
        if key not in self._built:
            self._built[key] = write_tiny_assistant(self.root / f"{variant}-assistant", variant)
        return self._built[key]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> TinyCheckpoints:
    """`tiny_checkpoints.get(variant, release_format=True, shards=1) -> Path` and
    `tiny_checkpoints.get_assistant(variant) -> Path`, for variant in ("dense", "moe", "ple")."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-ckpts"))


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The built-in demo model, built once per session: (its cache root, target_dir,
    assistant_dir)."""
    from gemma4serve.demo.checkpoints import ensure_demo_model

    root = tmp_path_factory.mktemp("demo-cache")
    target, assistant = ensure_demo_model(root)
    return root, target, assistant


@pytest.fixture(scope="session")
def trained_chat_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target trained to write known tool calls and thinking (tests/trained_chat.py) and its
    MTP assistant: (target_dir, assistant_dir), trained once per session."""
    from trained_chat import train_chat_checkpoint

    return train_chat_checkpoint(tmp_path_factory.mktemp("trained-chat"))
