"""Incremental detokenizer: deltas never split a character and reassemble the full decode."""
from __future__ import annotations

import numpy as np
import pytest

from jmtp.runtime.host.detokenizer import MAX_WINDOW, IncrementalDetokenizer

TEXTS = [
    "Hello world! 你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji: 😀🎉🦀🧑‍🚀 and flags 🇫🇷🇯🇵 mixed with 日本語のテキスト and ünïcödé.",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 ∑∫√ — 한국어 문장도 있습니다. " * 3,
]


def _stream(tok, ids, rng):
    detok = IncrementalDetokenizer(tok)
    deltas, i = [], 0
    while i < len(ids):
        n = int(rng.integers(1, 5))          # chunks of 1..4 tokens (several accepted per step)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_reassemble_cjk_and_emoji(smollm2_tokenizer, text, seed):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text                      # byte-level BPE round-trips
    detok, deltas = _stream(tok, ids, np.random.default_rng(seed))
    assert "".join(deltas) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)       # never a broken character


def test_split_characters_are_held_back(smollm2_tokenizer):
    """The text really splits characters across tokens (single tokens decode to U+FFFD), and a
    token-by-token stream emits each such character only once it is complete."""
    tok = smollm2_tokenizer
    text = TEXTS[1]
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "no split character: test is vacuous"
    detok = IncrementalDetokenizer(tok)
    for k, t in enumerate(ids):
        delta = detok.push([t])
        assert "\ufffd" not in delta
        # what was emitted is always a prefix of the full decode of the tokens so far
        assert tok.decode(ids[:k + 1]).startswith(detok.text)
    assert detok.flush() == "" and detok.text == text


def test_long_stream_slides_window(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "".join(TEXTS) * 2
    ids = tok.encode(text)
    assert len(ids) > 3 * MAX_WINDOW
    detok, deltas = _stream(tok, ids, np.random.default_rng(5))
    assert "".join(deltas) == text
    assert detok._start > 0                               # the window did slide


def test_incomplete_tail_is_flushed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ab🦀")
    cut = next(i for i in range(1, len(ids) + 1) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    assert "\ufffd" not in detok.push(ids[:cut])
    # the stream ends with a character that never completed: flush hands over what decode gives
    assert detok.text + detok.flush() == tok.decode(ids[:cut])
