"""The host's KV bookkeeping per verify step at batch 32: `KVManager.grow_all` and `page_tables`.

  python bench/bench_kv_host.py                       # contexts 1100, 8192, 32768, 131000
  python bench/bench_kv_host.py --contexts 4096 --no-prefix-caching

A continued step grows every sequence by its verify rows and rebuilds its page tables on the host
while the GPU runs the step before; past the GPU's step time, this is time the GPU waits. Pure
Python, so it runs anywhere (no GPU); the page sizes are the E4B's (40 full, 16 sliding tokens).
The first steps, which hash and offer a whole prompt to the prefix cache at once, are not timed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4serve.attention.metadata import page_tables  # noqa: E402
from gemma4serve.config import FULL, SLIDING  # noqa: E402
from gemma4serve.kv.manager import KVManager, SeqPages  # noqa: E402
from gemma4serve.kv.pool import PagePool  # noqa: E402
from gemma4serve.kv.prefix_cache import PrefixCache  # noqa: E402

PAGE_TOKENS = {FULL: 40, SLIDING: 16}
SLIDING_KEEP = 1027  # the E4B target's window (1024) and the drafter's reach past it
ROWS = 3  # tokens a verify step emits (forced acceptance 3.0) and rows it writes


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    num_prompt: int
    pages: SeqPages = field(default_factory=SeqPages)
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def per_step_ms(context: int, batch: int, steps: int, prefix_caching: bool) -> tuple[float, float]:
    pool = PagePool(batch * (context // 40 + context // 16 + 64) + 1)  # a whole prompt first
    cache = None
    if prefix_caching:
        cache = PrefixCache(
            pool,
            full_page_tokens=PAGE_TOKENS[FULL],
            sliding_page_tokens=PAGE_TOKENS[SLIDING],
            sliding_keep=SLIDING_KEEP,
            model_key="bench",
            window_interval=2048,
        )
    kv = KVManager(pool, PAGE_TOKENS, SLIDING_KEEP, SLIDING_KEEP + 4096, cache)
    seqs = [Sequence([(7 * i + j) % 1000 for j in range(context)], context) for i in range(batch)]
    for seq in seqs:
        kv.grow(seq, 0, context)
    grow = tables = 0.0
    position = context
    for step in range(steps + 3):
        for seq in seqs:
            seq.token_ids.extend(range(ROWS))
        t0 = time.perf_counter()
        assert kv.grow_all([(seq, position, position + 2 * ROWS) for seq in seqs])
        t1 = time.perf_counter()
        page_tables([seq.pages for seq in seqs])
        t2 = time.perf_counter()
        if step >= 3:
            grow, tables = grow + t1 - t0, tables + t2 - t1
        position += ROWS
    return grow / steps * 1e3, tables / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[1100, 8192, 32768, 131000])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    print("| context | grow_all ms | page_tables ms | per step, batch", args.batch, "|")
    print("|---|---|---|")
    for context in args.contexts:
        grow, tables = per_step_ms(context, args.batch, args.steps, not args.no_prefix_caching)
        print(f"| {context} | {grow:.3f} | {tables:.3f} |", flush=True)


if __name__ == "__main__":
    main()
