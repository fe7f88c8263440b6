"""The stop-string automaton against a brute-force oracle, and its cost with long lists."""

from __future__ import annotations

import random

import pytest

from gemma4serve.detokenizer import IncrementalDetokenizer
from gemma4serve.stop_strings import ROOT, StopStrings
from gemma4serve.tokenizer import Tokenizer


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: (end, stop) of the stop string that appears first in `text` (the one that ends
    first; of those ending at the same character, the longest)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text.endswith(s, 0, end)]
        if ending:
            return end, max(ending, key=len)
    return None


def longest_pending(text: str, stops: list[str]) -> int:
    return max(
        (n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])),
        default=0,
    )


@pytest.mark.parametrize("seed", range(200))
def test_matches_the_brute_force_oracle(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
        for _ in range(rng.randint(1, 6))
    ]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    automaton = StopStrings(stops)
    state, found = ROOT, None
    for end, char in enumerate(text, start=1):
        state = automaton.advance(state, char)
        if automaton.match_length(state):
            found = (end, text[end - automaton.match_length(state) : end])
            break
        assert automaton.pending_length(state) == longest_pending(text[:end], stops)
    assert found == first_stop(text, stops), (stops, text)


def test_overlapping_strings_cut_at_the_first_to_appear():
    automaton = StopStrings(["abcd", "bc", "c"])
    state = ROOT
    for char in "abc":
        state = automaton.advance(state, char)
    # "bc" and "c" end together at the third character: the longer one wins
    assert automaton.match_length(state) == 2


def test_empty_and_duplicate_strings_are_dropped():
    assert StopStrings(["", "x", "x", "y"]).strings == ("x", "y")
    assert not StopStrings([""])
    assert StopStrings("stop").strings == ("stop",)


def test_a_long_list_costs_per_character_not_per_string(tiny_checkpoints):
    """200,000 stop strings over 400 tokens, one token at a time as the engine pushes them: the
    old detokenizer tried every string after every token (minutes); the automaton steps one edge
    per character."""
    tok = Tokenizer.from_dir(tiny_checkpoints.get("dense"))
    text = "the robot said <12 and <99999 then walked on " * 40 + "<5> and more"
    ids = tok.encode(text)
    stops = StopStrings([f"<{i}>" for i in range(200_000)])
    detokenizer = IncrementalDetokenizer(tok, stop=stops)
    released, matched = "", None
    for token_id in ids:
        piece, matched = detokenizer.push([token_id])
        released += piece
        if matched:
            break
    assert matched == "<5>" and released == text[: text.index("<5>")]
