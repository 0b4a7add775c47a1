"""A content-addressed cache of generated token sequences with a manifest (training data that
sessions add to).

Layout of a cache directory::

    manifest.jsonl               one JSON line per shard, appended once the shard is on disk
    shards/<ab>/<sha256>.npz     one shard: the sequences of one generation job

A *job* is what was asked of the generator (a plain dict: the model's file digest, the
generator, temperature, ``max_tokens``, and the ``(prompt id, sample index, seed)`` of each
request); its *key* is the SHA-256 of its canonical JSON. A *shard* holds the sequences the job
produced; its file is named by the SHA-256 of its content (the token arrays and the per-sequence
metadata, canonically serialised: :func:`content_digest`), so a shard is verified on every load
and two equal shards are one file. The manifest maps job keys to shards, so a later run that
plans the same jobs skips them and only the new ones are generated ("resuming adds to it": more
samples per prompt, new prompts or another seed are new jobs).

Writes are crash-safe: a shard is written to a temporary file and renamed, then its manifest line
is appended; a line whose shard is missing or fails its digest is ignored (and its job planned
again). One writer at a time per directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
FORMAT = "jmtp-token-cache/1"


def canonical_json(obj) -> bytes:
    """``obj`` as canonical JSON bytes (sorted keys, no spaces): what job keys hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def job_key(job: dict) -> str:
    """SHA-256 (hex) of the canonical JSON of ``job``."""
    return hashlib.sha256(canonical_json(job)).hexdigest()


def content_digest(tokens: np.ndarray, seq_lens: np.ndarray, prompt_lens: np.ndarray,
                   meta: Sequence[dict]) -> str:
    """SHA-256 (hex) of a shard's content: ``tokens`` as little-endian i32, ``seq_lens`` and
    ``prompt_lens`` as little-endian i64, then the canonical JSON of ``meta``."""
    h = hashlib.sha256(FORMAT.encode())
    for a, dt in ((tokens, "<i4"), (seq_lens, "<i8"), (prompt_lens, "<i8")):
        a = np.ascontiguousarray(np.asarray(a).astype(dt))
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.tobytes())
    h.update(canonical_json(list(meta)))
    return h.hexdigest()


class TokenCache:
    """The cache in directory ``root`` (created if missing).

    A sequence is a dict with ``prompt_ids`` and ``response_ids`` (lists of token ids) and any
    JSON metadata (``prompt_id``, ``kind``, ``split``, ``seed``, ...), kept per sequence.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        os.makedirs(os.path.join(self.root, "shards"), exist_ok=True)
        self._entries: dict[str, dict] | None = None

    # ---------------------------------------------------------------- manifest
    def _shard_path(self, digest: str) -> str:
        return os.path.join(self.root, "shards", digest[:2], f"{digest}.npz")

    def entries(self) -> dict[str, dict]:
        """``{job key: manifest entry}`` of the shards on disk (the last line of a job wins;
        lines whose shard file is missing are left out)."""
        if self._entries is None:
            out: dict[str, dict] = {}
            path = os.path.join(self.root, MANIFEST)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            e = json.loads(line)
                        except json.JSONDecodeError:       # a line cut by a crash
                            log.warning("%s line %d: not JSON, ignored", path, n)
                            continue
                        if os.path.exists(self._shard_path(e["sha256"])):
                            out[e["job_key"]] = e
            self._entries = out
        return self._entries

    def has(self, job: dict) -> bool:
        """Whether the shard of ``job`` is in the cache."""
        return job_key(job) in self.entries()

    # ---------------------------------------------------------------- write
    def add(self, job: dict, sequences: Sequence[dict]) -> dict:
        """Store the ``sequences`` one ``job`` produced as a shard; returns its manifest entry.

        Raises:
          ValueError: no sequence, or a sequence without ``prompt_ids`` / ``response_ids``, or
            metadata that is not JSON.
        """
        if not sequences:
            raise ValueError("a shard needs at least one sequence")
        toks, lens, plens, meta = [], [], [], []
        for i, s in enumerate(sequences):
            if "prompt_ids" not in s or "response_ids" not in s:
                raise ValueError(f"sequence {i} needs 'prompt_ids' and 'response_ids'")
            p, r = list(map(int, s["prompt_ids"])), list(map(int, s["response_ids"]))
            toks += p + r
            lens.append(len(p) + len(r))
            plens.append(len(p))
            meta.append({k: v for k, v in s.items() if k not in ("prompt_ids", "response_ids")})
        tokens = np.asarray(toks, np.int32)
        seq_lens, prompt_lens = np.asarray(lens, np.int64), np.asarray(plens, np.int64)
        digest = content_digest(tokens, seq_lens, prompt_lens, meta)
        path = self._shard_path(digest)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp.{os.getpid()}.npz"
            np.savez(tmp, tokens=tokens, seq_lens=seq_lens, prompt_lens=prompt_lens,
                     meta=np.frombuffer(canonical_json(meta), np.uint8))
            os.replace(tmp, path)
        entry = {"job_key": job_key(job), "job": job, "sha256": digest,
                 "num_sequences": len(sequences), "num_tokens": int(len(tokens)),
                 "response_tokens": int(len(tokens) - prompt_lens.sum()),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(os.path.join(self.root, MANIFEST), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.entries()[entry["job_key"]] = entry
        return entry

    # ---------------------------------------------------------------- read
    def load_shard(self, digest: str) -> list[dict]:
        """The sequences of shard ``digest`` (as :meth:`add` took them).

        Raises:
          ValueError: the file's content does not hash to ``digest`` (a damaged shard).
        """
        with np.load(self._shard_path(digest)) as z:
            tokens, seq_lens, prompt_lens = z["tokens"], z["seq_lens"], z["prompt_lens"]
            meta = json.loads(z["meta"].tobytes())
        if content_digest(tokens, seq_lens, prompt_lens, meta) != digest:
            raise ValueError(f"token cache shard {digest[:12]} is damaged (content digest differs)")
        out, o = [], 0
        for n, p, m in zip(seq_lens, prompt_lens, meta):
            seq = tokens[o:o + int(n)]
            out.append({**m, "prompt_ids": seq[:int(p)].tolist(),
                        "response_ids": seq[int(p):].tolist()})
            o += int(n)
        return out

    def sequences(self, where=None) -> list[dict]:
        """Every sequence of the shards whose manifest entry satisfies ``where(entry)`` (all by
        default), shard by shard in manifest order; damaged shards are skipped with a warning
        (their jobs count as missing from then on)."""
        out = []
        for key, e in list(self.entries().items()):
            if where is not None and not where(e):
                continue
            try:
                out += self.load_shard(e["sha256"])
            except (ValueError, OSError, KeyError) as err:
                log.warning("skipping token cache shard %s: %s", e["sha256"][:12], err)
                del self.entries()[key]
        return out

    def summary(self, where=None) -> dict:
        """``{"shards", "sequences", "tokens", "response_tokens"}`` from the manifest."""
        es = [e for e in self.entries().values() if where is None or where(e)]
        return {"shards": len(es), "sequences": sum(e["num_sequences"] for e in es),
                "tokens": sum(e["num_tokens"] for e in es),
                "response_tokens": sum(e["response_tokens"] for e in es)}

    def missing(self, jobs: Iterable[dict]) -> list[dict]:
        """The jobs of ``jobs`` whose shards are not in the cache (in order)."""
        have = self.entries()
        return [j for j in jobs if job_key(j) not in have]
