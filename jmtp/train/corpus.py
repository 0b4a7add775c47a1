"""Teacher-forced text corpora for MTP training (more data per CPU-second than generation).

Self-distillation by generation (:mod:`jmtp.train.generation`) is exactly on the target's distribution
but costs one target decode step per token. A teacher-forced corpus costs one *prefill* row per
token (about 8x cheaper on a 2-core CPU for SmolLM2-135M): every text token is fed to the frozen
target once, and the label of each MTP row is still the target's own greedy prediction
(``labels="target"``, :func:`jmtp.train.data.target_top1`), i.e. exactly what greedy verification
accepts after that prefix. Only the prefixes come from the text. EAGLE (Li et al. 2024,
arXiv 2401.15077) trains its draft head on fixed human text the same way.

Each text chunk is wrapped as the assistant turn of a one-turn chat (a short user request naming
the chunk's topic), so the hidden states are those of the target answering a user, as at serving
time.

Sources jmtp knows how to read (both offline, both under the PSF licence):

* the reStructuredText sources of the Python documentation (``_sources/**/*.rst.txt`` of the Debian
  package ``python3.11-doc``, or any Sphinx build's ``_sources``): English prose with code;
* the pure-Python modules of the standard library (``sysconfig.get_paths()["stdlib"]``): code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sysconfig
from typing import Iterable, Sequence

PYTHON_DOCS_SOURCE = ("Python 3.11 documentation, reStructuredText sources (Debian package "
                      "python3.11-doc), PSF licence")
PYTHON_STDLIB_SOURCE = "Python 3.11 standard library sources (CPython), PSF licence"

PROSE_PROMPT = "Explain the following topic from the Python documentation: {title}"
CODE_PROMPT = "Show me Python code from the standard library module `{title}`."


@dataclasses.dataclass(frozen=True)
class Document:
    """One text of a corpus. ``kind`` is ``"prose"`` (markdown-like text) or ``"code"`` (Python)."""

    id: str
    title: str
    text: str
    kind: str


# --- reStructuredText → plain text ---------------------------------------------------------------

_ROLE = re.compile(r":[\w:.+-]+:`!?~?([^`<]*?)\s*(?:<[^>`]*>)?`")   # :func:`~a.b <x>` -> a.b
_LINK = re.compile(r"`([^`<]+?)\s*<[^>`]+>`_+")                       # `text <url>`_ -> text
_REF = re.compile(r"`([^`]+)`_+")                                     # `name`_ -> name
_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`:.])\1{2,}\s*$")
_OPTION = re.compile(r"^:[\w-]+:(\s.*)?$")
_DROP_DIRECTIVES = frozenset((
    "index", "toctree", "only", "highlight", "module", "currentmodule", "moduleauthor",
    "sectionauthor", "testsetup", "testcleanup", "image", "figure", "raw", "include",
    "literalinclude", "tabularcolumns", "audit-event", "productionlist", "c:namespace"))
_CODE_DIRECTIVES = frozenset(("code-block", "code", "sourcecode", "testcode", "doctest"))
_NOTE_DIRECTIVES = {"note": "Note", "warning": "Warning", "tip": "Tip", "important": "Important",
                    "seealso": "See also"}
_VERSION_DIRECTIVES = {"versionadded": "New in version", "versionchanged": "Changed in version",
                       "deprecated": "Deprecated since version"}


def clean_rst(text: str) -> str:
    """Sphinx reStructuredText → readable plain text (roles unwrapped, ``literals`` in single
    backquotes, directive and target lines and title underlines dropped, ``::`` → ``:``).

    Only a readable approximation is needed: the target reads it teacher-forced.
    """
    out, skip_indent = [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:           # options / body of a dropped directive
            if stripped and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        if stripped.startswith(".. "):
            m = re.match(r"\.\.\s+([\w:-]+)::\s*(.*)", stripped)
            name, arg = (m.group(1), m.group(2).strip()) if m else (None, "")
            if name is None or name in _DROP_DIRECTIVES:   # targets, comments, index, toctree...
                skip_indent = indent
                continue
            # Other directives keep their indented body: code blocks as they are, API
            # descriptions (function, class, method, ...) under their signature, notes and
            # version notes under a short label.
            if name in _CODE_DIRECTIVES:
                continue
            if name in _NOTE_DIRECTIVES:
                out.append(f"{_NOTE_DIRECTIVES[name]}: {arg}".rstrip())
                continue
            if name in _VERSION_DIRECTIVES:
                out.append(f"{_VERSION_DIRECTIVES[name]} {arg}:")
                continue
            if arg:
                out.append(_ROLE.sub(r"`\1`", arg))
            continue
        if _OPTION.match(stripped):                # ":noindex:", ":module: os" under a directive
            continue
        if _UNDERLINE.match(stripped):
            continue
        line = _ROLE.sub(r"`\1`", line)
        line = _LINK.sub(r"\1", line)
        line = _REF.sub(r"\1", line)
        line = line.replace("``", "`")
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-2].rstrip()
            line = (line + ":") if line else ""
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def _rst_title(text: str, fallback: str) -> str:
    lines = text.splitlines()
    for i in range(len(lines) - 1):
        if lines[i].strip() and _UNDERLINE.match(lines[i + 1].strip()) and not _UNDERLINE.match(
                lines[i].strip()):
            return _ROLE.sub(r"\1", lines[i].strip()).replace("``", "").strip()
    return fallback


def load_rst_documents(root: str, subdirs: Sequence[str] | None = None) -> list[Document]:
    """The ``*.rst.txt`` / ``*.rst`` files under ``root`` (optionally only ``subdirs``), cleaned.

    Raises:
      ValueError: if ``root`` is not a directory or holds no such file.
    """
    if not os.path.isdir(root):
        raise ValueError(f"corpus root {root!r} is not a directory")
    dirs = [os.path.join(root, s) for s in subdirs] if subdirs else [root]
    docs = []
    for d in dirs:
        for dirpath, _, files in sorted(os.walk(d)):
            for f in sorted(files):
                if not (f.endswith(".rst.txt") or f.endswith(".rst")):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    raw = fh.read()
                rel = os.path.relpath(path, root)
                text = clean_rst(raw)
                if text:
                    docs.append(Document(id=f"rst:{rel}", title=_rst_title(raw, rel), text=text,
                                         kind="prose"))
    if not docs:
        raise ValueError(f"no .rst/.rst.txt files under {root!r} (subdirs={subdirs})")
    return docs


_SKIP_STDLIB = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
                "turtledemo", "tkinter", "pydoc_data", "encodings", "__pycache__", "config-")


def load_python_sources(root: str | None = None) -> list[Document]:
    """The standard library's ``*.py`` files (tests, IDLE, tkinter, encodings and third-party
    packages excluded); ``root`` defaults to this interpreter's stdlib.

    Raises:
      ValueError: if ``root`` holds no Python file.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    docs = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(_SKIP_STDLIB))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("test_"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read().strip()
                if text:
                    docs.append(Document(id=f"py:{rel}", title=rel[:-3].replace(os.sep, "."),
                                         text=text, kind="code"))
    if not docs:
        raise ValueError(f"no Python files under {root!r}")
    return docs


# --- chunks → chat-wrapped token sequences ------------------------------------------------------


def split_blocks(text: str, max_chars: int) -> list[str]:
    """Split ``text`` at blank lines into chunks of at most ``max_chars`` characters (a single
    longer block is cut at line ends, then hard). Concatenating the chunks with blank lines gives
    back the text up to whitespace.

    Raises:
      ValueError: if ``max_chars < 1``.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if not block.strip():
            continue
        while len(block) > max_chars:
            cut = block.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            pieces.append(block[:cut])
            block = block[cut:].lstrip("\n")
        pieces.append(block)
    chunks, cur = [], ""
    for p in pieces:
        if cur and len(cur) + 2 + len(p) > max_chars:
            chunks.append(cur)
            cur = p
        else:
            cur = f"{cur}\n\n{p}" if cur else p
    if cur:
        chunks.append(cur)
    return chunks


def _mostly_text(chunk: str, min_letters: float = 0.45) -> bool:
    """False for ASCII tables, rulers and dumps (under ``min_letters`` of the characters letters)."""
    return sum(ch.isalpha() for ch in chunk) >= min_letters * max(len(chunk), 1)


def _order_key(seed: int, key: str) -> str:
    return hashlib.sha1(f"{seed}:{key}".encode()).hexdigest()


def corpus_sequences(tokenizer, docs: Iterable[Document], *, max_response_tokens: int = 448,
                     max_total_tokens: int | None = None, chars_per_chunk: int = 1400,
                     min_response_tokens: int = 32, seed: int = 0) -> list[dict]:
    """Chat-wrapped training sequences from documents, in a seeded hash order.

    Each chunk (:func:`split_blocks`) becomes ``prompt_ids`` = a one-turn chat asking for the
    document's topic (:func:`jmtp.train.prompts.encode_chat`) and ``response_ids`` = the chunk's
    tokens (code fenced as a markdown ``python`` block), cut at ``max_response_tokens``. Chunks
    that are mostly not letters (tables, rulers) or shorter than ``min_response_tokens`` are skipped.

    Args:
      max_total_tokens: stop once prompt + response tokens reach this budget (None: all chunks).

    Returns:
      dicts ``{"id", "kind", "prompt_ids", "response_ids"}``.

    Raises:
      ValueError: if a limit is not positive.
    """
    from jmtp.train.prompts import encode_chat

    if max_response_tokens < 1 or chars_per_chunk < 1 or (
            max_total_tokens is not None and max_total_tokens < 1):
        raise ValueError("max_response_tokens, chars_per_chunk and max_total_tokens must be >= 1")
    chunks = []
    for d in docs:
        for i, c in enumerate(split_blocks(d.text, chars_per_chunk)):
            if _mostly_text(c):
                chunks.append((_order_key(seed, f"{d.id}#{i}"), d, i, c))
    chunks.sort(key=lambda t: t[0])
    out, total, prompts = [], 0, {}
    for _, d, i, c in chunks:
        if d.id not in prompts:
            prompts[d.id] = encode_chat(
                tokenizer, (CODE_PROMPT if d.kind == "code" else PROSE_PROMPT).format(title=d.title))
        text = f"```python\n{c}\n```" if d.kind == "code" else c
        resp = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)][:max_response_tokens]
        if len(resp) < min_response_tokens:
            continue
        out.append({"id": f"{d.id}#{i}", "kind": f"corpus-{d.kind}", "prompt_ids": prompts[d.id],
                    "response_ids": resp})
        total += len(prompts[d.id]) + len(resp)
        if max_total_tokens is not None and total >= max_total_tokens:
            break
    return out
