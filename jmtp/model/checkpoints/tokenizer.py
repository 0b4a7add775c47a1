"""Tokenizers for jmtp checkpoints, built on the Hugging Face ``tokenizers`` library.

* GGUF files (``tokenizer.ggml.model == "gpt2"``): a byte-level BPE is rebuilt from
  ``tokenizer.ggml.tokens`` / ``.merges`` / ``.token_type``. Tokens marked *control* (type 3) become
  special added tokens, *user-defined* ones (type 4) plain added tokens, so both are matched whole
  in the text. The split regex follows ``tokenizer.ggml.pre`` as llama.cpp's ``llama-vocab.cpp``
  defines it (GPT-2 pattern by default; SmolLM/StarCoder additionally isolate every digit;
  Llama-3 and Qwen2 use their own patterns).
* Hugging Face directories: ``tokenizer.json`` as is, with ``tokenizer_config.json`` (and
  ``chat_template.jinja`` when present) for the chat template and special tokens.

Chat templates are rendered with a sandboxed Jinja2 environment configured like transformers'
``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that
does not escape HTML, ``raise_exception`` and ``strftime_now`` globals).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex or None for the GPT-2 pattern, isolate digits, ignore_merges)
GGUF_PRE_TOKENIZERS = {
    "default": (None, False, False),
    "gpt2": (None, False, False),
    "gpt-2": (None, False, False),
    "smollm": (None, True, False),
    "starcoder": (None, True, False),
    "refact": (None, True, False),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
    "qwen2": (_QWEN2_SPLIT, False, False),
}
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map (Radford et al. 2019, ``encoder.py``)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text ⇄ token ids, plus the checkpoint's chat template.

    Attributes:
      eos_token_ids: tuple of ids that end generation.
      bos_token_id: id prepended when ``add_special_tokens`` and the checkpoint asks for it (or None).
      chat_template: Jinja2 source (or None).
      vocab_size: number of ids the tokenizer can produce (base vocabulary + added tokens).
    """

    def __init__(self, backend: _HFTokenizer, *, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, source: str = ""):
        self.backend = backend
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.source = source

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: BOS/EOS as the checkpoint's post-processor
        says). Special-token strings in ``text`` (e.g. ``<|im_start|>``) map to their ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special_tokens``.

        Raises:
          ValueError: if an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside [0, vocab_size={self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special_token_ids(self) -> dict[str, int]:
        """``{text: id}`` of the special (control) tokens, the ones
        ``decode(..., skip_special_tokens=True)`` leaves out."""
        return {t.content: int(i) for i, t in self.backend.get_added_tokens_decoder().items()
                if t.special}

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the checkpoint's chat
        template. Extra keyword arguments are passed to the template.

        Raises:
          ValueError: if the checkpoint has no chat template or ``messages`` is malformed.
        """
        if not self.chat_template:
            raise ValueError(f"{self.source}: tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        ctx = dict(self.special_tokens)
        ctx.update(kwargs)
        return _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **ctx)


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
    """Byte-level BPE tokenizer stored in a GGUF file (see module docstring).

    Raises:
      ValueError: naming the field for a non-BPE vocabulary (``tokenizer.ggml.model`` != ``gpt2``),
        missing merges, or an unknown ``tokenizer.ggml.pre``.
    """
    from jmtp.model.checkpoints.gguf_loader import gguf_tokenizer_data

    where = os.fspath(path)
    data = gguf_tokenizer_data(where)
    if data["model"] != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model = {data['model']!r} is not supported "
                         "(only byte-level BPE, 'gpt2')")
    if not data["merges"]:
        raise ValueError(f"{where}: missing metadata field 'tokenizer.ggml.merges'")
    pre = data["pre"] or "default"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer.ggml.pre = {pre!r} is not supported; known: "
                         f"{', '.join(GGUF_PRE_TOKENIZERS)}")
    split, digits, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
    table = _byte_alphabet()
    alphabet = set(table.values())
    tokens = data["tokens"]
    # Tokens are stored in the byte alphabet; respell any that are not (as transformers does).
    spelled = [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in data["merges"]]
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                                      fuse_unk=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    tt = data["token_type"]
    if tt is not None:
        control = [AddedToken(tokens[i], special=True, normalized=False)
                   for i in range(len(tokens)) if tt[i] == TOKEN_TYPE_CONTROL
                   and set(tokens[i]) <= alphabet]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i in range(len(tokens)) if tt[i] == TOKEN_TYPE_USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
    bos, eos = data["bos_token_id"], data["eos_token_ids"]
    single, specials = ["$A"], []
    if data["add_bos"] and bos is not None:
        single.insert(0, tokens[bos])
        specials.append((tokens[bos], int(bos)))
    if data["add_eos"] and eos:
        single.append(tokens[eos[0]])
        specials.append((tokens[eos[0]], int(eos[0])))
    if specials:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=list(dict.fromkeys(specials)))
    special_names = {}
    if bos is not None:
        special_names["bos_token"] = tokens[bos]
    if eos:
        special_names["eos_token"] = tokens[eos[0]]
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=bos,
                     chat_template=data["chat_template"], special_tokens=special_names, source=where)


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def tokenizer_from_hf_dir(path: str | os.PathLike) -> Tokenizer:
    """Tokenizer of a transformers checkpoint directory (``tokenizer.json`` required).

    EOS ids are the union of ``tokenizer_config.json``'s ``eos_token`` and the ``eos_token_id``
    fields of ``config.json`` / ``generation_config.json``.

    Raises:
      ValueError: if ``tokenizer.json`` is missing or unreadable.
    """
    d = Path(path)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise ValueError(f"{d}: missing tokenizer.json (only fast-tokenizer files are supported)")
    try:
        backend = _HFTokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{tj}: cannot read tokenizer ({e})") from None

    def read(name):
        p = d / name
        return json.loads(p.read_text()) if p.is_file() else {}

    tc, cfg, gen = read("tokenizer_config.json"), read("config.json"), read("generation_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    specials = {k: _token_content(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                      "pad_token")}
    specials = {k: v for k, v in specials.items() if v}
    eos: list[int] = []
    if specials.get("eos_token") and backend.token_to_id(specials["eos_token"]) is not None:
        eos.append(backend.token_to_id(specials["eos_token"]))
    for src in (cfg, gen):
        v = src.get("eos_token_id")
        for i in (v if isinstance(v, list) else [v]):
            if i is not None and int(i) not in eos:
                eos.append(int(i))
    bos = backend.token_to_id(specials["bos_token"]) if specials.get("bos_token") else None
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=bos, chat_template=template,
                     special_tokens=specials, source=str(d))
