"""Streaming detokenization with stop strings.

Text comes from `tokenizers.decoders.DecodeStream`, which holds back tokens until they decode to
whole UTF-8 characters (a CJK character or an emoji split over several `<0xNN>` byte-fallback
tokens is released only once complete). On top of that, stop strings are matched on the decoded
text (`StopStrings`, in time proportional to the new text), so a stop string can span any number
of tokens, and any tail of the text that could still grow into a stop string is held back until
it either matches (cut there) or can no longer match (released).

The released text equals `tokenizer.decode(all_ids)` cut before the first stop string to appear
(the one that ends first; of two ending at the same character, the longer), as long as the byte
tokens form valid UTF-8. A model can emit invalid byte runs (e.g. a lone lead byte
followed by a complete character); a full decode then turns the whole run into U+FFFD, after the
stream has already released the valid character. The stream cannot take released text back, so it
keeps it and shows only the stray bytes as U+FFFD.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from gemma4serve.stop_strings import ROOT, StopStrings


def _backend(tokenizer) -> HFTokenizer:
    return tokenizer if isinstance(tokenizer, HFTokenizer) else tokenizer.backend


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: StopStrings | list[str] | tuple[str, ...] = (),
        include_stop_str_in_output=False,
    ):
        self._tok = _backend(tokenizer)
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._undecoded: list[int] = []  # ids the stream has taken but not turned into text yet
        self._held = ""  # decoded text not yet released (it could be the start of a stop string)
        # One automaton per request, shared by its choices; this choice keeps its state.
        self.stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._state = ROOT
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # everything released so far
        self.matched_stop: str | None = None

    def _step(self, token_id: int) -> str:
        self._undecoded.append(token_id)
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception:
            # DecodeStream raises when a new token changes text it already returned (an invalid
            # byte run, see the module doc). Release what the pending ids decode to on their own and
            # start afresh: Gemma's decoder is context-free outside byte runs, so nothing is lost.
            piece = self._tok.decode(self._undecoded, skip_special_tokens=self._skip_special)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        if piece is None:
            return ""
        self._undecoded.clear()
        return piece

    def push(self, token_ids: list[int], may_stop: bool = True) -> tuple[str, str | None]:
        """Feed new token ids; return (text releasable now, the stop string that matched or None).

        After a stop string matched, further ids are ignored. `may_stop=False` (before vLLM's
        min_tokens are out) lets stop strings pass that end in this text.
        """
        if self.matched_stop is not None:
            return "", self.matched_stop
        new_text = "".join(self._step(int(token_id)) for token_id in token_ids)
        if not self.stops:
            self.text += new_text
            return new_text, None
        pending = self._held + new_text
        stops, state = self.stops, self._state
        for position in range(len(self._held), len(pending)):
            state = stops.advance(state, pending[position])
            length = stops.match_length(state)
            if length and may_stop:  # the first stop string to appear; cut the text there
                end = position + 1
                stop = pending[end - length : end]
                out = pending[:end] if self.include_stop_str_in_output else pending[: end - length]
                self._held = ""
                self._undecoded.clear()
                self.matched_stop = stop
                self.text += out
                return out, stop
        self._state = state
        # Release all but the tail that could still grow into a stop string.
        keep = stops.pending_length(state)
        out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out, None

    def flush(self) -> str:
        """At the end of generation, release the held-back text and what the stream still buffers.

        An unfinished byte sequence decodes to U+FFFD, as in a full decode.
        """
        if self.matched_stop is not None:
            return ""
        out = self._held
        if self._undecoded:
            out += self._tok.decode(self._undecoded, skip_special_tokens=self._skip_special)
            self._undecoded.clear()
        self._held = ""
        self.text += out
        return out
