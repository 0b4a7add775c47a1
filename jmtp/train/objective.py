"""MTP-head objective and evaluation: pure functions of the MTP params over one packed batch.

Objective (DeepSeek-V3 MTP, arXiv 2412.19437, its multi-token prediction section; EAGLE, arXiv
2401.15077): MTP row ``p`` sees the target's post-norm hidden state ``h_p`` and the token
``x_{p+1}`` and predicts ``x_{p+2}`` through the target's frozen LM head:

* ``CE``: cross-entropy against the data token ``x_{p+2}`` (the target's own generation);
* optional ``KL(p_target(. | h_{p+1}) || p_mtp)``, the target's distribution for the same token
  (weight ``kl_weight``);
* optional recursive passes (``num_passes > 1``): the same layer re-run as draft substeps, fed its
  own output hidden state, under the exact attention context of inference (see
  :mod:`jmtp.train.dense`); pass ``i >= 2`` losses are weighted by ``recursive_weight``.

Optional FR-Spec draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): with
``draft_vocab_size = N`` the loss and the draft's predictions use only the N most frequent tokens
of the training responses (the LM head ``head_w`` restricted to those columns, ``label_map``
mapping full ids to them), which cuts the dominant LM-head cost of a small model's training step.

Evaluation (on prompts never trained on): with greedy target responses, a draft is accepted iff it
equals the target's argmax. ``acc1`` = first-draft acceptance = top-1 agreement of pass-1 with the
target argmax ``argmax compute_logits(h_{p+1})``; ``acc1_label`` = top-1 agreement with the data token;
``chain_k`` = fraction of start rows whose first ``k`` drafts are all accepted (pass ``i`` run at row
``r+i-1``); ``al_K = 1 + sum_{k<=K} chain_k`` estimates the mean acceptance length (tokens per verify
step) at ``K`` drafts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.train.config import TrainConfig
from jmtp.train.dense import dense_mtp_forward


def _forward(cfg, tcfg, mtp, frozen, batch, num_passes, noise_key=None):
    params = dict(frozen, mtp=mtp)
    hidden = batch["hidden"]
    if noise_key is not None and tcfg.feature_noise > 0:
        hidden = hidden + tcfg.feature_noise * jax.random.normal(noise_key, hidden.shape, hidden.dtype)
    return dense_mtp_forward(cfg, params, batch["ids"], hidden, batch["positions"],
                             batch["segment_ids"], num_passes, tcfg.layer_idx)


def _logits(h, head_w):
    return jnp.dot(h, head_w, preferred_element_type=jnp.float32).astype(jnp.float32)


def loss_fn(mtp, frozen, head_w, label_map, batch, noise_key, *, cfg: ModelConfig, tcfg: TrainConfig):
    """Scalar loss and metrics of one batch (see module docstring).

    ``head_w f[H, V']`` is the (possibly FR-Spec restricted) frozen LM head; ``label_map i32[V]``
    maps full ids to columns of ``head_w`` (-1 = outside the draft vocabulary: no loss).
    """
    outs = _forward(cfg, tcfg, mtp, frozen, batch, tcfg.num_passes, noise_key)
    labels = label_map[batch["labels"]]
    mask = batch["loss_mask"] * (labels >= 0)
    labels = jnp.maximum(labels, 0)
    t_logp = None
    if tcfg.kl_weight > 0:
        t_logp = jax.nn.log_softmax(_logits(batch["target_hidden"], head_w), axis=-1)
        t_logp = jax.lax.stop_gradient(t_logp)
    total, metrics = 0.0, {}
    for i, (h, _, valid) in enumerate(outs):
        logp = jax.nn.log_softmax(_logits(h, head_w), axis=-1)              # f32[B, W, V']
        m = mask * valid
        denom = jnp.maximum(m.sum(), 1.0)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        ce = (nll * m).sum() / denom
        term = ce
        if t_logp is not None:
            kl = (jnp.exp(t_logp) * (t_logp - logp)).sum(-1)
            term = term + tcfg.kl_weight * (kl * m).sum() / denom
        total = total + (1.0 if i == 0 else tcfg.recursive_weight) * term
        metrics[f"ce{i + 1}"] = ce
        metrics[f"acc{i + 1}_train"] = ((logp.argmax(-1) == labels) * m).sum() / denom
    metrics["loss"] = total
    return total, metrics


def eval_batch(mtp, frozen, head_w, full_head_w, draft_ids, batch, *, cfg: ModelConfig,
               tcfg: TrainConfig):
    """Per-row eval arrays of one batch: for each pass ``i`` a pair ``bool[B,W]`` (draft == target
    argmax, draft == data label) and ``valid_i bool[B,W]``; plus ``loss_mask`` and the pass-1 CE."""
    outs = _forward(cfg, tcfg, mtp, frozen, batch, tcfg.eval_passes)
    target_arg = _logits(batch["target_hidden"], full_head_w).argmax(-1)
    res = {"mask": batch["loss_mask"] > 0}
    for i, (h, _, valid) in enumerate(outs):
        logits = _logits(h, head_w)
        pred = draft_ids[logits.argmax(-1)]
        res[f"greedy{i + 1}"] = pred == target_arg
        res[f"label{i + 1}"] = pred == batch["labels"]
        res[f"valid{i + 1}"] = valid
        if i == 0:
            full_logp = jax.nn.log_softmax(_logits(h, full_head_w), axis=-1)
            nll = -jnp.take_along_axis(full_logp, batch["labels"][..., None], axis=-1)[..., 0]
            res["nll_sum"] = (nll * batch["loss_mask"]).sum()
    return res


def summarize_eval(parts: list[dict], passes: int) -> dict:
    """Acceptance statistics from :func:`eval_batch` outputs (host side, numpy)."""
    cat = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0] if k != "nll_sum"}
    mask = cat["mask"]
    n = max(int(mask.sum()), 1)
    out = {"eval_rows": int(mask.sum()),
           "eval_ce": float(sum(float(p["nll_sum"]) for p in parts) / n)}
    for i in range(1, passes + 1):
        ok = mask & cat[f"valid{i}"]
        den = max(int(ok.sum()), 1)
        out[f"acc{i}"] = float((cat[f"greedy{i}"] & ok).sum() / den)
        out[f"acc{i}_label"] = float((cat[f"label{i}"] & ok).sum() / den)
    # Chains: start row r accepted k deep iff pass i (1..k) at row r+i-1 is right.
    w = mask.shape[1]
    for kind, suffix in (("greedy", ""), ("label", "_label")):
        alive = np.ones_like(mask)
        exists = np.ones_like(mask)
        al = 1.0
        for k in range(1, passes + 1):
            sh = k - 1
            corr = np.zeros_like(mask)
            ok = np.zeros_like(mask)
            corr[:, :w - sh] = cat[f"{kind}{k}"][:, sh:]
            ok[:, :w - sh] = (mask & cat[f"valid{k}"])[:, sh:]
            alive = alive & corr
            exists = exists & ok
            chain = float((alive & exists).sum() / max(exists.sum(), 1))
            al += chain
            out[f"chain{k}{suffix}"] = chain
            out[f"al{k}{suffix}"] = al
    return out
