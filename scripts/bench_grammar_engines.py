#!/usr/bin/env python
"""llguidance (jmtp's grammar engine) against xgrammar on SmolLM2's tokenizer (issue 37).

For one JSON schema and one valid document, both engines build their tokenizer data, compile the
schema, then fill the next-token bitmask before each of the document's tokens; printed: tokenizer
set-up, schema compile, mean and p99 mask time, and (llguidance) forced-token time and the cost of
copying a matcher. xgrammar is not a jmtp dependency (it needs torch and triton): install it with
``pip install --no-deps xgrammar apache-tvm-ffi`` (torch is in the test extra) to compare; the
script skips it otherwise.

    python scripts/bench_grammar_engines.py
"""
from __future__ import annotations

import json
import time

import numpy as np

SCHEMA = {"type": "object", "required": ["name", "age", "tags", "address"], "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
             "minItems": 1},
    "address": {"type": "object", "required": ["street_name", "zip"], "properties": {
        "street_name": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
DOC = {"name": "Bob", "age": 33, "tags": ["a", "ccc"],
       "address": {"street_name": "Main St", "zip": "12345"}}


def us(xs) -> str:
    return f"mean {np.mean(xs) * 1e6:6.1f} µs, p99 {np.percentile(xs, 99) * 1e6:6.1f} µs"


def main():
    from jmtp.model.checkpoints.loader import smollm2_path
    from jmtp.model.checkpoints.tokenizer import tokenizer_from_gguf
    from jmtp.runtime.host.structured import StructuredOutputsParams
    from jmtp.runtime.host.structured.grammar import GrammarCompiler

    tok = tokenizer_from_gguf(smollm2_path())
    V = tok.vocab_size
    ids = tok.encode(json.dumps(DOC, separators=(", ", ": ")))
    print(f"SmolLM2 tokenizer: V={V}; document of {len(ids)} tokens")

    t0 = time.perf_counter()
    gc = GrammarCompiler(tok, V, tok.eos_token_ids)
    t1 = time.perf_counter()
    g = gc.matcher(StructuredOutputsParams(json=SCHEMA))
    t2 = time.perf_counter()
    row = np.zeros(gc.num_words, np.int32)
    masks, ffs, copies = [], [], []
    for t in ids:
        a = time.perf_counter()
        g.fill_mask(row)
        masks.append(time.perf_counter() - a)
        a = time.perf_counter()
        g.matcher.compute_ff_tokens()
        ffs.append(time.perf_counter() - a)
        a = time.perf_counter()
        g.matcher.deep_copy()
        copies.append(time.perf_counter() - a)
        g.commit([t])
    assert g.error is None and g.matcher.is_accepting()
    print(f"llguidance: tokenizer {t1 - t0:.3f} s, compile+matcher {(t2 - t1) * 1e3:.1f} ms; "
          f"mask {us(masks)}; forced tokens {us(ffs)}; copy {us(copies)}")

    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        print(f"xgrammar: skipped ({e})")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                                              vocab_size=V, stop_token_ids=list(tok.eos_token_ids))
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")))
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, V)
    masks = []
    for t in ids:
        a = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - a)
        assert matcher.accept_token(t)
    print(f"xgrammar:   tokenizer {t1 - t0:.3f} s, compile+matcher {(t2 - t1) * 1e3:.1f} ms; "
          f"mask {us(masks)} (no token-level forced-token call)")


if __name__ == "__main__":
    main()
