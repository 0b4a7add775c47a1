"""A tiny byte-level BPE tokenizer for structured-output tests on tiny random models.

Ids: 0 ``<pad>``, 1 ``<eos>`` (the tiny models' EOS), then the 95 printable ASCII characters,
then merges of frequent JSON pieces (``{"``, ``":``, ``",``, ``"}`` and a few letter pairs), 128
ids in all: a model with ``vocab_size=128`` can produce every id, and the merges give the grammar
engine several tokenizations of the same text (so forced bytes are not always a single token).
"""
from __future__ import annotations

import functools

import numpy as np
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from jmtp.model import forward_logits
from jmtp.model.checkpoints.tokenizer import Tokenizer
from jmtp.runtime.host.structured.grammar import GrammarCompiler, unpack_row

VOCAB_SIZE = 128
MERGES = ['{"', '":', '",', '"}', 'ab', 'ba', 'na', 'me', 'ag', 'ge', 'tr', 'ue', 'al', 'se',
          'an', 'on', 'in', 'er', 'at', 'es', 'or', 'le', 'is', 'it', 'nam', 'name', 'age',
          'true', 'fal', 'false']


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    """A jmtp :class:`~jmtp.model.checkpoints.tokenizer.Tokenizer` over the 128-id byte-level BPE."""
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def enc(s):
        return "".join(p[0] for p in bl.pre_tokenize_str(s))

    vocab = {"<pad>": 0, "<eos>": 1}
    for c in (chr(i) for i in range(32, 127)):
        vocab[enc(c)] = len(vocab)
    merges = []
    for piece in MERGES:
        # split the piece into a known prefix and a known last part
        for cut in range(len(piece) - 1, 0, -1):
            a, b = enc(piece[:cut]), enc(piece[cut:])
            if a in vocab and b in vocab:
                merges.append((a, b))
                vocab[a + b] = len(vocab)
                break
    while len(vocab) < VOCAB_SIZE:       # unused filler ids, never produced by encoding
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = bl
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<pad>", special=True),
                                AddedToken("<eos>", special=True)])
    return Tokenizer(backend, eos_token_ids=(1,), source="tiny-bpe")


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


@functools.lru_cache(maxsize=None)
def compiler() -> GrammarCompiler:
    """The grammar compiler of the tiny tokenizer (EOS id 1)."""
    return GrammarCompiler(tiny_tokenizer(), VOCAB_SIZE, (1,))


def reference_constrained_greedy(cfg, params, constraint, prompt_ids, max_tokens):
    """Greedy decoding through the plain (non-paged) forward, masking one token at a time with a
    fresh matcher: the independent reference of constrained greedy decoding."""
    g = compiler().matcher(constraint)
    ids, out = list(prompt_ids), []
    row = np.zeros(g.num_words, np.int32)
    while len(out) < max_tokens:
        padded = ids + [0] * (-len(ids) % 64)
        logits = np.asarray(forward_logits(cfg, params, padded, block_size=64))[len(ids) - 1]
        g.fill_mask(row)
        logits = np.where(unpack_row(row, cfg.vocab_size), logits, -np.inf)
        t = int(np.argmax(logits))
        out.append(t)
        ids.append(t)
        if t == 1:
            break
        g.commit([t])
    return out
