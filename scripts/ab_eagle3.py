#!/usr/bin/env python
"""A/B of EAGLE-3's lessons for jmtp's MTP head, at small scale, by held-out acceptance.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) trains its draft head (1) on its own previous-step
outputs for multi-step drafting ("training-time test": jmtp's recursive passes,
``TrainConfig.num_passes``) and (2) on the target's hidden states from several layers (low, mid,
high) fused by a linear layer, instead of the last layer's alone. This script trains fresh heads
that differ in one of these only, on the same cached self-generated data, with the same seed,
steps and hyper-parameters, and reports the held-out first-draft acceptance and acceptance
lengths at K = 1..4 (teacher-forced, equal to greedy verification's; jmtp.train.objective).

Arms: ``pN`` = N recursive passes; ``pNfeat`` = the same with the multi-layer input: the MTP
head's hidden input becomes ``[rms(f_a); rms(f_b); ...; h] @ W`` (``f_i`` the residual stream
after target layer i, ``--feature-layers``; ``W`` initialised to pass ``h`` through, so the arm
starts where ``pN`` starts). Later passes feed the head its own output, as both EAGLE-3 and jmtp's
inference do. The engine feeds the last layer only: a feature arm that wins is a measurement, not
a head the engine can run yet.

Data: the token cache and hidden-state cache of a ``scripts/train_mtp.py --generator engine`` run
(``--data-dir``), the first ``--train-seqs`` training sequences and every evaluation sequence.

    nice -n 19 python scripts/ab_eagle3.py --data-dir runs/mtp/data --arms p1,p2,p2feat \\
        --steps 250 --json runs/ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data-dir", required=True, help="train_mtp.py's data dir (tokens/ inside)")
    ap.add_argument("--arms", default="p1,p2,p2feat")
    ap.add_argument("--feature-layers", default="2,15,27",
                    help="target layers fused by the feature arms (SmolLM2: 30 layers)")
    ap.add_argument("--train-seqs", type=int, default=160)
    ap.add_argument("--gen-max-tokens", type=int, default=256, help="eval responses' limit")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import optax

    from jmtp.model.llama import rms_norm
    from jmtp.model.checkpoints.loader import load_checkpoint
    from jmtp.model.params import init_mtp_params
    from jmtp.train.capture import capture_hidden
    from jmtp.train.config import TrainConfig
    from jmtp.train.data import build_dataset, make_batch, pack_rows, target_top1, token_frequencies
    from jmtp.train.objective import eval_batch, loss_fn, summarize_eval
    from jmtp.train.step import make_optimizer
    from jmtp.train.token_cache import TokenCache
    sys.path.insert(0, HERE)
    from train_mtp import model_digest

    cfg, params = load_checkpoint(a.model, mtp_head=None)
    digest = model_digest(a.model)
    cache = TokenCache(os.path.join(a.data_dir, "tokens"))
    mine = lambda e, split: e["job"].get("model") == digest and e["job"]["split"] == split
    train_seqs = cache.sequences(lambda e: mine(e, "train"))[:a.train_seqs]
    eval_seqs = cache.sequences(lambda e: mine(e, "eval") and e["job"]["kind"] == "greedy"
                                and e["job"]["max_tokens"] == a.gen_max_tokens)
    layers = tuple(int(x) for x in a.feature_layers.split(","))
    t0 = time.perf_counter()

    def dataset(seqs):
        toks = [s["prompt_ids"] + s["response_ids"] for s in seqs]
        hid, feats = capture_hidden(cfg, params, toks, batch_tokens=4096, feature_layers=layers,
                                    progress=True)
        d = build_dataset(cfg, params, toks, [len(s["prompt_ids"]) for s in seqs],
                          [s["prompt_id"] for s in seqs], [s["kind"] for s in seqs], hidden=hid)
        d.top1 = target_top1(cfg, params, d.hidden)
        return d, np.concatenate(feats)

    train, train_f = dataset(train_seqs)
    evald, eval_f = dataset(eval_seqs)
    capture_s = time.perf_counter() - t0
    print(f"data: {train.num_sequences} train sequences ({len(train.tokens)} tokens), "
          f"{evald.num_sequences} eval ({len(evald.tokens)}); features of layers {layers} "
          f"captured in {capture_s:.0f} s", flush=True)
    freq = token_frequencies(train, cfg.vocab_size)
    dv = np.asarray(freq[0][:a.train_vocab], np.int32)
    lm = np.full(cfg.vocab_size, -1, np.int32)
    lm[dv] = np.arange(len(dv), dtype=np.int32)
    full_w = params["lm_head"] if "lm_head" in params else params["embed"].T
    head_w, label_map, draft_ids = full_w[:, jnp.asarray(dv)], jnp.asarray(lm), jnp.asarray(dv)
    frozen = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
    h = cfg.hidden_size
    nf = len(layers)

    def fused(fuse, batch, feats):
        if fuse is None:
            return batch["hidden"]
        parts = [rms_norm(feats[:, :, j], fuse["norm"][j], cfg.rms_norm_eps) for j in range(nf)]
        return jnp.concatenate(parts + [batch["hidden"]], axis=-1) @ fuse["w"]

    def batches(data, feats, rows, tcfg, with_labels=True):
        b = make_batch(data, rows, tcfg.seq_len, labels="target" if with_labels else "data",
                       prompt_rows=with_labels)
        f = np.where((b["segment_ids"] >= 0)[..., None, None], feats[b["src"]], 0).astype(np.float32)
        return {k: jnp.asarray(v) for k, v in b.items()}, jnp.asarray(f)

    results = []
    for arm in a.arms.split(","):
        passes = int(arm[1:].replace("feat", ""))
        feat = arm.endswith("feat")
        tcfg = TrainConfig(steps=a.steps, batch_size=a.batch, seq_len=a.seq_len, lr=a.lr,
                           warmup_steps=max(a.steps // 20, 1), seed=a.seed, num_passes=passes,
                           kl_weight=0.5, feature_noise=0.05, draft_vocab_size=a.train_vocab,
                           labels="target", prompt_rows=True, eval_passes=4, progress=False)
        mtp = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32),
                                     init_mtp_params(cfg, params, jax.random.PRNGKey(a.seed)))
        fuse = None
        if feat:   # starts as the identity on h: the arm begins where the plain arm begins
            w = np.zeros(((nf + 1) * h, h), np.float32)
            w[nf * h:] = np.eye(h, dtype=np.float32)
            fuse = {"w": jnp.asarray(w), "norm": jnp.ones((nf, h), jnp.float32)}
        tx = make_optimizer(tcfg)
        state = {"mtp": mtp, "fuse": fuse}
        opt = tx.init(state)

        @jax.jit     # frozen tensors are arguments, not constants baked into the program
        def step(state, opt, batch, feats, key, frozen, head_w, label_map):
            def obj(st):
                b = dict(batch, hidden=fused(st["fuse"], batch, feats))
                return loss_fn(st["mtp"], frozen, head_w, label_map, b, key, cfg=cfg, tcfg=tcfg)
            (loss, _), g = jax.value_and_grad(obj, has_aux=True)(state)
            upd, opt = tx.update(g, opt, state)
            return optax.apply_updates(state, upd), opt, loss

        @jax.jit
        def evaluate(state, batch, feats, frozen, head_w, full_w, draft_ids):
            b = dict(batch, hidden=fused(state["fuse"], batch, feats))
            return eval_batch(state["mtp"], frozen, head_w, full_w, draft_ids, b, cfg=cfg,
                              tcfg=tcfg)

        rows = pack_rows(train, a.seq_len, prompt_rows=True)
        rng = np.random.default_rng([a.seed, 0])
        order = np.concatenate([rng.permutation(len(rows)) for _ in
                                range(-(-a.steps * a.batch // len(rows)))])
        key = jax.random.PRNGKey(a.seed + 1)
        t1 = time.perf_counter()
        for s in range(a.steps):
            batch, feats = batches(train, train_f, [rows[i] for i in
                                                    order[s * a.batch:(s + 1) * a.batch]], tcfg)
            key, sub = jax.random.split(key)
            state, opt, loss = step(state, opt, batch, feats, sub, frozen, head_w, label_map)
            if s % 50 == 0 or s == a.steps - 1:
                print(f"  [{arm}] step {s} loss {float(loss):.3f}", flush=True)
        train_s = time.perf_counter() - t1
        ev_rows = pack_rows(evald, a.seq_len)
        parts = []
        for i in range(0, len(ev_rows), a.batch):
            chunk = list(ev_rows[i:i + a.batch])
            real = len(chunk)
            chunk += [[]] * (a.batch - real)
            batch, feats = batches(evald, eval_f, chunk, tcfg, with_labels=False)
            res = evaluate(state, batch, feats, frozen, head_w, full_w, draft_ids)
            parts.append({k: (np.asarray(v)[:real] if np.ndim(v) else np.asarray(v))
                          for k, v in res.items()})
        ev = summarize_eval(parts, 4)
        row = {"arm": arm, "num_passes": passes, "features": list(layers) if feat else [],
               "train_seconds": train_s, **{k: ev[k] for k in
                                            ("eval_rows", "eval_ce", "acc1", "acc2", "al1", "al2",
                                             "al3", "al4")}}
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| arm | passes | input | held-out acc1 | acc2 | AL K=1 | K=2 | K=3 | K=4 | eval CE |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        inp = f"layers {r['features']} + last" if r["features"] else "last layer"
        print(f"| {r['arm']} | {r['num_passes']} | {inp} | {r['acc1']:.3f} | {r['acc2']:.3f} | "
              f"{r['al1']:.3f} | {r['al2']:.3f} | {r['al3']:.3f} | {r['al4']:.3f} | "
              f"{r['eval_ce']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "train_tokens": int(len(train.tokens)),
                       "eval_tokens": int(len(evald.tokens)), "capture_seconds": capture_s,
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    raise SystemExit(main())
