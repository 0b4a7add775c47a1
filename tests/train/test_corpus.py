"""Teacher-forced corpora (jmtp.train.corpus) and MTPData.concat: hand-worked cases, no model."""
from __future__ import annotations

import numpy as np
import pytest

from jmtp.train import corpus as C
from jmtp.train import data as D


class CharTokenizer:
    """One id per character; the chat template is ``U:<text>|A:``."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"U:{m['content']}|" for m in messages if m["role"] == "user") + "A:"


RST = """\
.. _tut-if:

:keyword:`!if` Statements
=========================

Perhaps the most well-known statement is :keyword:`if`.  See :func:`~os.path.join <x>` and
``len(x)`` or `the docs <https://docs.python.org>`_.  For example::

   >>> x = 1

.. index::
   single: if
   statement: elif

.. note:: Keep it short.

.. function:: join(a, *p)
   :noindex:

   Join one or more paths.

   .. versionchanged:: 3.6
      Accepts a path-like object.

.. toctree::
   :maxdepth: 2

   other

Done.
"""


def test_clean_rst_hand_worked():
    assert C.clean_rst(RST) == (
        "`if` Statements\n\n"
        "Perhaps the most well-known statement is `if`.  See `os.path.join` and\n"
        "`len(x)` or the docs.  For example:\n\n"
        "   >>> x = 1\n\n"
        "Note: Keep it short.\n\n"
        "join(a, *p)\n\n"
        "   Join one or more paths.\n\n"
        "Changed in version 3.6:\n"
        "      Accepts a path-like object.\n\n"
        "Done.")


def test_split_blocks_respects_the_limit_and_keeps_the_text():
    text = "aaa bbb\nccc\n\nddd\n\n\n" + "e" * 25 + "\nfff"
    chunks = C.split_blocks(text, 12)
    assert all(len(c) <= 12 for c in chunks)
    assert "".join("".join(chunks).split()) == "".join(text.split())
    assert C.split_blocks("ab\n\ncd", 100) == ["ab\n\ncd"]
    with pytest.raises(ValueError, match="max_chars"):
        C.split_blocks("x", 0)


def test_corpus_sequences_wrap_chunks_as_chat_turns(tmp_path):
    tok = CharTokenizer()
    docs = [C.Document("d1", "Topic", "hello world, " * 3 + "\n\nsecond paragraph here", "prose"),
            C.Document("c1", "mod", "def f(x):\n    return x + 1", "code"),
            C.Document("t1", "Table", "+-----+-----+\n| 1   | 2   |\n+-----+-----+", "prose")]
    seqs = C.corpus_sequences(tok, docs, chars_per_chunk=40, min_response_tokens=10, seed=0)
    by_id = {s["id"]: s for s in seqs}
    # the table is skipped (mostly not letters); the prose splits at its blank line
    assert set(by_id) == {"d1#0", "d1#1", "c1#0"}
    d0 = by_id["d1#0"]
    assert "".join(map(chr, d0["prompt_ids"])) == "U:" + C.PROSE_PROMPT.format(title="Topic") + "|A:"
    assert "".join(map(chr, d0["response_ids"])) == "hello world, " * 3
    assert by_id["d1#1"]["kind"] == "corpus-prose"
    c0 = by_id["c1#0"]
    assert "".join(map(chr, c0["prompt_ids"])) == "U:" + C.CODE_PROMPT.format(title="mod") + "|A:"
    assert "".join(map(chr, c0["response_ids"])) == "```python\ndef f(x):\n    return x + 1\n```"
    # same seed -> same order; cut at max_response_tokens; the budget stops early
    assert [s["id"] for s in C.corpus_sequences(tok, docs, chars_per_chunk=40, seed=0,
                                                min_response_tokens=10)] == [s["id"] for s in seqs]
    short = C.corpus_sequences(tok, docs, chars_per_chunk=40, max_response_tokens=11,
                               min_response_tokens=10)
    assert all(len(s["response_ids"]) == 11 for s in short)
    one = C.corpus_sequences(tok, docs, chars_per_chunk=40, min_response_tokens=10,
                             max_total_tokens=1)
    assert len(one) == 1
    with pytest.raises(ValueError, match="max_response_tokens"):
        C.corpus_sequences(tok, docs, max_response_tokens=0)


def test_loaders_read_rst_and_python_trees(tmp_path):
    (tmp_path / "docs" / "tutorial").mkdir(parents=True)
    (tmp_path / "docs" / "tutorial" / "a.rst.txt").write_text(RST)
    (tmp_path / "docs" / "other.txt").write_text("not rst")
    docs = C.load_rst_documents(str(tmp_path / "docs"), ["tutorial"])
    assert [(d.id, d.title, d.kind) for d in docs] == [("rst:tutorial/a.rst.txt", "if Statements",
                                                        "prose")]
    with pytest.raises(ValueError, match="no .rst"):
        C.load_rst_documents(str(tmp_path / "docs"), ["missing"])
    with pytest.raises(ValueError, match="not a directory"):
        C.load_rst_documents(str(tmp_path / "nope"))
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "test").mkdir()
    (lib / "pkg" / "m.py").write_text("x = 1\n")
    (lib / "test" / "t.py").write_text("y = 2\n")
    (lib / "test_z.py").write_text("z = 3\n")
    assert [(d.id, d.title) for d in C.load_python_sources(str(lib))] == [("py:pkg/m.py", "pkg.m")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Python files"):
        C.load_python_sources(str(tmp_path / "empty"))


def _data(lens, seed):
    rng = np.random.default_rng(seed)
    n = sum(lens)
    return D.MTPData(tokens=rng.integers(0, 9, n).astype(np.int32),
                     hidden=rng.standard_normal((n, 3)).astype(np.float16),
                     offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     prompt_lens=np.ones(len(lens), np.int32),
                     prompt_ids=[f"p{seed}{i}" for i in range(len(lens))],
                     kinds=["greedy"] * len(lens), top1=rng.integers(0, 9, n).astype(np.int32))


def test_mtpdata_concat_equals_the_whole():
    whole = _data([4, 2, 5], 0)
    parts = [whole.subset([0, 1]), whole.subset([2])]
    got = D.MTPData.concat(parts)
    for f in ("tokens", "hidden", "offsets", "prompt_lens", "top1"):
        np.testing.assert_array_equal(getattr(got, f), getattr(whole, f))
    assert got.prompt_ids == whole.prompt_ids and got.kinds == whole.kinds
    with pytest.raises(ValueError, match="at least one"):
        D.MTPData.concat([])
    no_top1 = whole.subset([0])
    no_top1.top1 = None
    with pytest.raises(ValueError, match="top1"):
        D.MTPData.concat([whole, no_top1])
