"""Self-generated training data at scale: one serving engine answers many prompts, and every
finished job lands in a :class:`~jmtp.train.token_cache.TokenCache`.

* :func:`plan_jobs` — the generation jobs of a run: for each prompt of a split and each sample
  index, one request ``(prompt id, sample index, seed)``, grouped ``shard_size`` requests to a
  job. A request's seed depends only on ``(seed, prompt id, sample index)``, so jobs are the same
  in every session and a cache already holding some of them is only topped up.
* :class:`EngineGenerator` — one :class:`jmtp.LLM` (no speculation, lazy compiles) kept for the
  whole run, fed through :class:`~jmtp.runtime.host.llm_engine.LLMEngine`'s step loop: requests of
  several jobs are in flight at once (continuous batching at ``batch_size`` slots), and a job's
  shard is written as soon as its last request finishes.
* :meth:`EngineGenerator.fill` — runs the missing jobs of a plan until they are done or a time or
  token budget is spent (a budget stops new jobs; jobs in flight finish), and reports tokens/s.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Sequence

import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.train.token_cache import TokenCache, canonical_json, job_key

log = logging.getLogger(__name__)


def request_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The sampling seed of request ``(prompt_id, sample)`` of a run seeded ``seed`` (a 31-bit
    int from SHA-256, independent of which other requests exist)."""
    d = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(d[:4], "little") & 0x7FFFFFFF


def plan_jobs(prompts: Sequence[tuple[str, Sequence[int]]], *, model: str, split: str, kind: str,
              temperature: float, max_tokens: int, samples: Sequence[int], seed: int = 0,
              shard_size: int = 256, top_k: int = 0) -> list[dict]:
    """Generation jobs (plain dicts, the cache's keys) for ``prompts = [(prompt id, ids)]``.

    Args:
      model: the target's identity (e.g. the SHA-256 of its checkpoint file); part of each key.
      split / kind: recorded with every sequence (``"train"``/``"eval"``, ``"greedy"``/...).
      samples: sample indices per prompt (``range(4)``, later ``range(4, 8)`` adds to a cache).
      shard_size: requests per job (one shard each).

    Raises:
      ValueError: ``shard_size < 1``, ``max_tokens < 1``, a negative temperature.
    """
    if shard_size < 1 or max_tokens < 1 or temperature < 0:
        raise ValueError("shard_size and max_tokens must be >= 1 and temperature >= 0")
    reqs = [(pid, list(map(int, ids)), s) for s in samples for pid, ids in prompts]
    jobs = []
    for i in range(0, len(reqs), shard_size):
        part = reqs[i:i + shard_size]
        jobs.append({
            "model": model, "generator": "engine", "split": split, "kind": kind,
            "temperature": float(temperature), "top_k": int(top_k), "max_tokens": int(max_tokens),
            "requests": [[pid, s, request_seed(seed, pid, s) if temperature > 0 else 0]
                         for pid, _, s in part],
            # the prompts' token ids (the tokenizer and chat template are part of the job)
            "prompts_sha256": hashlib.sha256(canonical_json([ids for _, ids, _ in part]))
            .hexdigest()})
    return jobs


class EngineGenerator:
    """One plain serving engine for a whole generation run.

    Args:
      cfg, params: the target (``params["mtp"]`` is dropped: no speculation).
      batch_size: engine slots (``max_num_seqs``).
      max_model_len: longest prompt + response the engine must hold.
      dtype: engine dtype (default: the params' own).
      compile: ``"lazy"`` (default): only the buckets the run uses.
    """

    def __init__(self, cfg: ModelConfig, params: dict, *, batch_size: int, max_model_len: int,
                 dtype=None, compile: str = "lazy", **engine_args):
        from jmtp.runtime.host.llm import LLM
        target = {k: v for k, v in params.items() if k != "mtp"}
        self.llm = LLM(model_config=cfg, params=target, max_num_seqs=batch_size,
                       max_model_len=max_model_len, dtype=dtype or params["embed"].dtype,
                       compile=compile, **engine_args)
        self.engine = self.llm.llm_engine
        self.batch_size = batch_size

    def fill(self, cache: TokenCache, jobs: Sequence[dict], prompts: dict[str, Sequence[int]],
             *, seconds: float | None = None, max_new_tokens: int | None = None,
             progress: bool = False) -> dict:
        """Generate the jobs of ``jobs`` missing from ``cache`` (in order) and store each.

        Args:
          prompts: ``{prompt id: token ids}`` for every request of ``jobs``.
          seconds / max_new_tokens: budgets; once one is spent no new job starts (jobs in flight
            finish, so a run overshoots by at most the jobs in flight).

        Returns:
          ``{"jobs_done", "jobs_left", "sequences", "tokens", "seconds", "tokens_per_second",
          "steps"}`` of this call (tokens: generated response tokens).
        """
        from jmtp.runtime.host.sampling_params import SamplingParams

        todo = list({job_key(j): j for j in cache.missing(jobs)}.values())   # each job once
        eng = self.engine
        t0 = time.perf_counter()
        steps0 = eng.num_steps
        pending: dict[str, dict] = {}      # job key -> {"job", "outs": [..], "left": n}
        rid_of: dict[str, tuple[str, int]] = {}
        done = toks = seqs = 0
        nxt = 0
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), desc="generate jobs", unit="job")

        def budget_left() -> bool:
            if seconds is not None and time.perf_counter() - t0 >= seconds:
                return False
            return max_new_tokens is None or toks < max_new_tokens

        def start(job):
            key = job_key(job)
            pending[key] = {"job": job, "outs": [None] * len(job["requests"]),
                            "left": len(job["requests"])}
            for i, (pid, s, rseed) in enumerate(job["requests"]):
                rid = f"{key[:16]}/{i}"
                rid_of[rid] = (key, i)
                sp = SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"],
                                    top_k=job["top_k"], seed=rseed if job["temperature"] else None)
                eng.add_request(rid, list(prompts[pid]), sp)

        while True:
            # keep about two batches of requests queued so no slot idles between jobs
            while nxt < len(todo) and budget_left() and \
                    eng.get_num_unfinished_requests() < 2 * self.batch_size:
                start(todo[nxt])
                nxt += 1
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                if not out.finished:
                    continue
                key, i = rid_of.pop(out.request_id)
                p = pending[key]
                p["outs"][i] = list(map(int, out.outputs[0].token_ids))
                p["left"] -= 1
                toks += len(p["outs"][i])
                if p["left"] == 0:
                    job = p["job"]
                    cache.add(job, [
                        {"prompt_ids": list(prompts[pid]), "response_ids": resp, "prompt_id": pid,
                         "sample": s, "seed": rseed, "kind": job["kind"], "split": job["split"]}
                        for (pid, s, rseed), resp in zip(job["requests"], p["outs"])])
                    seqs += len(job["requests"])
                    del pending[key]
                    done += 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        dt = time.perf_counter() - t0
        return {"jobs_done": done, "jobs_left": len(todo) - done, "sequences": seqs,
                "tokens": toks, "seconds": dt, "tokens_per_second": toks / max(dt, 1e-9),
                "steps": eng.num_steps - steps0}


def cached_records(cache: TokenCache, model: str, split: str) -> list[dict]:
    """The sequences of ``cache`` generated for ``model`` in ``split``, in a stable order (by
    prompt id, sample index, then kind), as ``scripts/train_mtp.py`` records: ``prompt_id``,
    ``kind``, ``split``, ``prompt_ids``, ``response_ids``."""
    recs = cache.sequences(lambda e: e["job"].get("model") == model
                           and e["job"].get("split") == split)
    recs.sort(key=lambda r: (r["prompt_id"], r.get("sample", 0), r.get("kind", ""),
                             r.get("seed", 0)))
    return recs


def response_token_count(recs: Sequence[dict]) -> int:
    """Generated tokens in ``recs``."""
    return int(np.sum([len(r["response_ids"]) for r in recs])) if recs else 0


def shard_data(cache: TokenCache, entries: Sequence[dict], cfg: ModelConfig, params: dict, *,
               hidden_dir: str | None = None, batch_tokens: int = 8192, top1_chunk: int = 1024,
               progress: bool = False):
    """The :class:`~jmtp.train.data.MTPData` (hidden states and target top-1 included) of the
    cache shards ``entries``, concatenated in their order; None when ``entries`` is empty.

    Hidden states are captured with :func:`jmtp.train.capture.capture_hidden` (``batch_tokens``
    per call). With ``hidden_dir`` each shard's data is saved there under its content digest and
    reused by later runs (a CPU session captures only the shards added since the last one);
    ``hidden_dir`` must be specific to the target (its states differ per model).
    """
    import os
    import shutil

    from jmtp.train.capture import capture_hidden
    from jmtp.train.data import MTPData, build_dataset, target_top1

    parts = []
    it = entries
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(entries, desc="hidden states", unit="shard")
    for e in it:
        d_dir = os.path.join(hidden_dir, e["sha256"][:32]) if hidden_dir else None
        if d_dir and os.path.exists(os.path.join(d_dir, "meta.json")):
            parts.append(MTPData.load(d_dir))
            continue
        seqs = cache.load_shard(e["sha256"])
        toks = [s["prompt_ids"] + s["response_ids"] for s in seqs]
        hid, _ = capture_hidden(cfg, params, toks, batch_tokens=batch_tokens)
        d = build_dataset(cfg, params, toks, [len(s["prompt_ids"]) for s in seqs],
                          [s["prompt_id"] for s in seqs], [s["kind"] for s in seqs], hidden=hid)
        d.top1 = target_top1(cfg, params, d.hidden, chunk=top1_chunk)
        if d_dir:
            shutil.rmtree(d_dir + ".tmp", ignore_errors=True)
            d.save(d_dir + ".tmp")
            os.replace(d_dir + ".tmp", d_dir)
        parts.append(d)
    return MTPData.concat(parts) if parts else None
