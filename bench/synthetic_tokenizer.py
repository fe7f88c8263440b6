"""Writes a Gemma-4-shaped tokenizer of a full vocab size for benchmarks on configs/ (which hold no
tokenizer): the demo tokenizer's 512 ids (specials, bytes, merges) followed by synthetic pieces.

A grammar's per-step mask cost grows with the vocab and with how many tokens hold the grammar's
characters, so the pieces mix words, digits, JSON punctuation and whitespace runs as a real
vocab does. Usage: python bench/synthetic_tokenizer.py OUT_DIR [--vocab-size 262144]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

from gemma4serve.demo.checkpoints import TOKENIZER_CONFIG
from gemma4serve.demo.tokenizer import build_tiny_tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéüñçøåß"
PUNCTUATION = [
    '"', '":', '{"', '"}', "},", "],", '",', "[", "]", "{", "}", ":", ",", "\\n", "'", ".",
]  # fmt: skip


def synthetic_piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.70:  # a word, mostly with the leading "▁" of a space
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 12)))
        return ("▁" if rng.random() < 0.7 else "") + word
    if kind < 0.80:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
    if kind < 0.95:
        return "".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(1, 3)))
    return rng.choice(["▁", "\n", "\t"]) * rng.randint(2, 16)


def write_synthetic_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> None:
    tiny = json.loads(build_tiny_tokenizer().to_str())
    vocab: dict[str, int] = tiny["model"]["vocab"]
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        vocab.setdefault(synthetic_piece(rng), len(vocab))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(json.dumps(tiny))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=262144)
    args = parser.parse_args()
    write_synthetic_tokenizer(args.out_dir, args.vocab_size)
    size = Tokenizer.from_file(str(args.out_dir / "tokenizer.json")).get_vocab_size()
    print(f"wrote {args.out_dir}/tokenizer.json: {size} ids")


if __name__ == "__main__":
    main()
