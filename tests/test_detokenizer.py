"""Streaming detokenization: multi-byte characters and stop strings across tokens, hold-back."""

from __future__ import annotations

import random

import pytest

from gemma4serve.detokenizer import IncrementalDetokenizer
from gemma4serve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoints.get("dense"))


def stream(tok, ids, chunk=1, **kw) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    pieces, stop = [], None
    for i in range(0, len(ids), chunk):
        text, stop = d.push(ids[i : i + chunk])
        pieces.append(text)
        if stop is not None:
            break
    if stop is None:
        pieces.append(d.flush())
    return pieces, stop, d


def test_multibyte_characters_stream_whole(tok):
    text = "naïve café: 日本語 😀👍🏽 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte fallback split the characters over several tokens
    pieces, stop, d = stream(tok, ids)
    assert stop is None
    assert "".join(pieces) == text == d.text
    assert not any("\ufffd" in p for p in pieces)
    # The emoji's four byte tokens release nothing until the last one.
    emoji = tok.encode("😀")
    d = IncrementalDetokenizer(tok)
    assert [d.push([i])[0] for i in emoji] == ["", "", "", "😀"]


def test_special_tokens_skipped_or_kept(tok):
    ids = [2, 105] + tok.encode("model\nHi") + [106]
    assert "".join(stream(tok, ids)[0]) == "model\nHi" == tok.decode(ids)
    kept = "".join(stream(tok, ids, skip_special_tokens=False)[0])
    assert kept == "<bos><|turn>model\nHi<turn|>" == tok.decode(ids, skip_special_tokens=False)


def test_stop_string_across_tokens(tok):
    text = "the robot was very happy. The END of it"
    ids = tok.encode(text)
    pieces, stop, d = stream(tok, ids, stop=["END"])
    assert stop == "END"
    assert "".join(pieces) == "the robot was very happy. The " == d.text
    pieces, stop, _ = stream(tok, ids, stop=["END"], include_stop_str_in_output=True)
    assert "".join(pieces) == "the robot was very happy. The END"
    # The earliest match wins, whatever the order of the stop list.
    pieces, stop, _ = stream(tok, ids, stop=["of it", "very happy"])
    assert stop == "very happy" and "".join(pieces) == "the robot was "


def test_stop_string_inside_one_token(tok):
    ids = tok.encode("the robot sang")
    assert "▁robot" in [tok.id_to_token(i) for i in ids]
    pieces, stop, _ = stream(tok, ids, stop=["ob"])
    assert stop == "ob" and "".join(pieces) == "the r"


def test_hold_back_until_stop_cannot_match(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP!"])
    assert d.push(tok.encode("say ST")) == ("say ", None)  # "ST" could start "STOP!"
    assert d.push(tok.encode("O")) == ("", None)
    assert d.push(tok.encode("P")) == ("", None)
    assert d.push(tok.encode("S and go")) == ("STOPS and go", None)  # no longer a match: released
    assert d.push(tok.encode(" STOP")) == (" ", None)
    assert d.flush() == "STOP"  # generation ended without the "!"
    assert d.text == "say STOPS and go STOP"


def test_stop_string_across_a_multibyte_character(tok):
    ids = tok.encode("hi 日本語 and more")
    pieces, stop, _ = stream(tok, ids, stop=["本語"])
    assert stop == "本語" and "".join(pieces) == "hi 日"
    assert not any("\ufffd" in p for p in pieces)


def test_after_stop_further_ids_are_ignored(tok):
    d = IncrementalDetokenizer(tok, stop=["x"])
    assert d.push(tok.encode("ax")) == ("a", "x")
    assert d.push(tok.encode("more")) == ("", "x")
    assert d.flush() == ""


def test_unfinished_character_is_flushed_like_a_full_decode(tok):
    ids = tok.encode("ok 😀")[:-2]
    d = IncrementalDetokenizer(tok)
    assert d.push(ids)[0] == "ok "
    assert d.flush() == tok.decode(ids)[len("ok ") :]


def test_invalid_byte_run_keeps_streaming(tok):
    """A lone lead byte before a complete character: DecodeStream refuses it, we keep going."""
    lead = tok.token_to_id("<0xE6>")
    ids = tok.encode("a日") + [lead] + tok.encode("b c")
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push([i])[0] for i in ids) + d.flush()
    assert out == "a日\ufffdb c"


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_equal_full_decode_cut_at_stop(tok, seed):
    rng = random.Random(seed)
    words = ["the", "robot", "日本", "😀", "sang", "END", "é", "\n", "<|turn>", "ok", "STOP", "a"]
    text = " ".join(rng.choice(words) for _ in range(40))
    ids = tok.encode(text)
    stops = rng.sample(["END", "STOP", "sang the", "本😀", "zzz"], 2)
    chunk = rng.randint(1, 4)
    for include in (False, True):
        pieces, stop, _ = stream(
            tok, ids, chunk=chunk, stop=stops, include_stop_str_in_output=include
        )
        full = tok.decode(ids)
        hits = [(full.find(s), s) for s in stops if s in full]
        if hits:
            i, s = min(hits)
            assert stop == s
            assert "".join(pieces) == (full[: i + len(s)] if include else full[:i])
        else:
            assert stop is None and "".join(pieces) == full
