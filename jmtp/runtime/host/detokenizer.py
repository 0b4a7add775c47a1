"""Incremental detokenization for streaming: text grows only by whole characters.

Algorithm (the usual offset-window scheme of streaming detokenizers, e.g. HF ``TextStreamer`` and
vLLM's ``detokenize_incrementally``): decode a short window of the latest tokens, starting a few
tokens before the text not yet emitted so that decoders which treat the first token specially
(SentencePiece's leading space) decode it in context. The window's text past what was already
emitted is the new text, except trailing U+FFFD characters: those are bytes of a multi-byte UTF-8
character whose remaining bytes come in later tokens, so they are held back until completed (or
until :meth:`IncrementalDetokenizer.flush` at the end). When the window holds no pending bytes it
slides forward, keeping ``CONTEXT_TOKENS`` tokens of context, so each push decodes O(window) tokens.
"""
from __future__ import annotations

from typing import Iterable

#: Tokens of already-emitted text kept at the start of the decode window.
CONTEXT_TOKENS = 4
#: The window slides forward once it holds more than this many tokens.
MAX_WINDOW = 32
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str``
        (:class:`jmtp.model.checkpoints.tokenizer.Tokenizer`).
      skip_special_tokens: passed to ``decode`` (special tokens such as EOS decode to "").

    Attributes:
      token_ids: every id pushed so far.
      text: the text emitted so far (the concatenation of every returned delta). After
        :meth:`flush` it equals ``tokenizer.decode(token_ids)`` for byte-level BPE and
        SentencePiece tokenizers.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._start = 0         # token index where the decode window starts
        self._emitted = 0       # characters of the window's text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Iterable[int]) -> str:
        """Append ``ids`` and return the newly completed text ("" if none is complete yet)."""
        self.token_ids.extend(int(t) for t in ids)
        window = self._decode(self.token_ids[self._start:])
        end = len(window)
        while end > self._emitted and window[end - 1] == _REPLACEMENT:
            end -= 1                      # an incomplete multi-byte character: hold it back
        delta = window[self._emitted:end]
        self._emitted = max(self._emitted, end)
        self.text += delta
        if end == len(window) and len(self.token_ids) - self._start > MAX_WINDOW:
            self._start = len(self.token_ids) - CONTEXT_TOKENS
            self._emitted = len(self._decode(self.token_ids[self._start:]))
        return delta

    def flush(self) -> str:
        """Return whatever is held back (trailing U+FFFD of bytes that never completed)."""
        window = self._decode(self.token_ids[self._start:])
        delta = window[self._emitted:]
        self._emitted = len(window)
        self.text += delta
        return delta
