"""Lossless speculative sampling, checked by distribution on a tiny Markov-chain "model".

Target and draft are fixed random logit tables ``T[prev] f[V]`` and ``D[prev] f[V]`` (the next-token
logits depend on the previous token only). Each of N >= 200k seeded requests starts after the
prompt token ``x0`` and runs the speculative loop -- K drafts from D (greedy, or sampled with the
exact q), target window rows ``T[x_last], T[d_1], .., T[d_K]``, :func:`verify`, emit, update the
history -- until at least 3 tokens are emitted. The empirical joint distribution of the first 3
tokens must match the exact one, computed in float64 from the target alone with the sequential
reference processors of test_sampling.py (temperature / top-p / top-k / min-p and penalties, whose
history includes every emitted token), to total-variation distance < 0.01.

Negative controls show the test can fail: the lossy FastDeploy ``topp`` rule, and rejection
sampling fed a one-hot q while the drafts were actually sampled (transformers#47932-style bug).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.runtime.device import sampling as smp, verify as vf
from jmtp.runtime.host import sampling_rows as rows
from jmtp.runtime.host.sampling_params import SamplingParams

_spec = importlib.util.spec_from_file_location(
    "_jmtp_sampling_ref", pathlib.Path(__file__).with_name("test_sampling.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

V = 6
N = 200_000          # seeded requests per setting
X0 = 0               # the prompt (one token)
STEPS = 3            # every step emits >= 1 token: 3 steps give >= 3 tokens
_rng = np.random.default_rng(7)
T_TABLE = (_rng.normal(size=(V, V)) * 2.2).astype(np.float32)
D_TABLE = (T_TABLE + _rng.normal(size=(V, V)) * 1.2).astype(np.float32)   # decent, imperfect


def exact_joint(params: SamplingParams) -> np.ndarray:
    """f64[V, V, V]: P(t1, t2, t3) of non-speculative sampling from the target."""
    out = np.zeros((V, V, V))
    for hist in itertools.product(range(V), repeat=3):
        prob = 1.0
        for i, tok in enumerate(hist):
            prev = X0 if i == 0 else hist[i - 1]
            p = ref.ref_params_probs(T_TABLE[prev], [X0], list(hist[:i]), params)
            prob *= p[tok]
            if prob == 0:
                break
        out[hist] = prob
    return out


def expected_tv(p: np.ndarray, n: int) -> float:
    """E[TV] of an n-sample empirical distribution under the truth p (normal approximation)."""
    p = p.reshape(-1)
    return 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * n))))


KMAX = 3             # window shape; K = 2 runs use num_drafts = 2 in it (no extra compilation)


@functools.partial(jax.jit, static_argnames=("strategy", "pass_q"))
def simulate(a, num_drafts, draft_temperature, distort_q, *, strategy, pass_q):
    """First 3 emitted tokens ``i32[B, 3]`` of the speculative loop for every slot of ``a``.

    Drafts: ``num_drafts`` (<= KMAX) per step from the draft table at ``draft_temperature``
    (0 = greedy drafts, q one-hot). ``pass_q``: hand q to the verifier (else None = one-hot).
    """
    T = jnp.asarray(T_TABLE)
    D = jnp.asarray(D_TABLE)
    B = a.temperature.shape[0]
    eos = jnp.array([-1], jnp.int32)
    nd = jnp.full((B,), num_drafts, jnp.int32)

    def step(carry, _):
        a, last, ng, out = carry

        def draft(prev, k):
            tok, q = smp.draft_sample(D[prev], a, ng + k, draft_sampling=True,
                                      draft_temperature=draft_temperature, draft_top_p=1.0,
                                      draft_top_k=0)
            return tok, (tok, q)

        _, (d, q) = jax.lax.scan(draft, last, jnp.arange(KMAX))
        d, q = d.T, jnp.swapaxes(q, 0, 1)                               # [B, K], [B, K, V]
        wrong = jnp.sqrt(q) / jnp.sum(jnp.sqrt(q), axis=-1, keepdims=True)
        q = jnp.where(distort_q, wrong, q)          # negative control: q != the sampling dist
        # (drafts use the draft table at draft_temperature only: no top-p/top-k of the request)
        inputs = jnp.concatenate([last[:, None], d], axis=1)            # [B, K+1]
        r = vf.verify(T[inputs], d, nd, q if pass_q else None, a, ng, eos, strategy=strategy)
        n = r.accept_num
        idx = ng[:, None] + jnp.arange(KMAX + 1)[None, :]
        keep = (jnp.arange(KMAX + 1)[None, :] < n[:, None]) & (idx < out.shape[1])
        out = out.at[jnp.arange(B)[:, None], jnp.where(keep, idx, out.shape[1])].set(
            r.accept_tokens, mode="drop")
        last = jnp.take_along_axis(r.accept_tokens, (n - 1)[:, None], axis=1)[:, 0]
        a = smp.update_history(a, r.accept_tokens, n)
        return (a, last, ng + n, out), None

    init = (a, jnp.full((B,), X0, jnp.int32), jnp.zeros((B,), jnp.int32),
            jnp.full((B, 3), -1, jnp.int32))
    (_, _, _, out), _ = jax.lax.scan(step, init, None, length=STEPS)
    return out


G = 2048             # greedy requests riding in the same batch (one batch mixes both)
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4)


def run_tv(params, *, K, draft_sampling, strategy="rejection", distort_q=False):
    """Simulate N requests with ``params`` plus G greedy ones in the same batch.

    Returns (TV, expected TV, empirical f[V^3], exact f[V^3], greedy outputs i32[G, 3]).
    """
    a = rows.pack_sampling([params, GREEDY], 2, V, prompts=[[X0], [X0]])
    a = jax.tree.map(lambda x: x[np.repeat([0, 1], [N, G])], a)
    a = dataclasses.replace(a, seed=jnp.arange(N + G, dtype=jnp.uint32) * 7919 + 13)
    out = np.asarray(simulate(a, jnp.int32(K), jnp.float32(1.0 if draft_sampling else 0.0),
                              jnp.asarray(distort_q), strategy=strategy,
                              pass_q=strategy == "rejection" and draft_sampling))
    assert np.all(out >= 0)
    sampled, greedy = out[:N], out[N:]
    emp = np.bincount(sampled[:, 0] * V * V + sampled[:, 1] * V + sampled[:, 2],
                      minlength=V**3) / N
    truth = exact_joint(params).reshape(-1)
    assert abs(truth.sum() - 1) < 1e-9
    return 0.5 * float(np.abs(emp - truth).sum()), expected_tv(truth, N), emp, truth, greedy


SETTINGS = {
    "t0.6": SamplingParams(temperature=0.6),
    "t0.8_p0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "t1.3_k3": SamplingParams(temperature=1.3, top_k=3),
    "t1_p0.9_k4_minp": SamplingParams(temperature=1.0, top_p=0.9, top_k=4, min_p=0.1),
    "penalties": SamplingParams(temperature=0.5, repetition_penalty=1.4, frequency_penalty=0.6,
                                presence_penalty=0.3),
}

CASES = [   # (K, draft_sampling, strategy, setting)
    (2, False, "rejection", "t0.6"),
    (2, True, "rejection", "t0.8_p0.9"),
    (3, False, "rejection", "penalties"),
    (3, True, "rejection", "t1_p0.9_k4_minp"),
    (3, True, "target_match", "t1.3_k3"),
]


@pytest.mark.parametrize("K,draft_sampling,strategy,name", CASES)
def test_speculative_sampling_is_lossless(K, draft_sampling, strategy, name):
    tv, etv, emp, truth, greedy = run_tv(SETTINGS[name], K=K, draft_sampling=draft_sampling,
                                         strategy=strategy)
    assert etv < 0.005, f"{name}: setting too flat for N={N} (expected TV {etv:.4f})"
    assert tv < 0.01, f"{name}: TV {tv:.4f} (expected {etv:.4f})"
    # zero-probability outcomes (top-k / top-p / min-p) never appear
    assert emp[truth == 0].sum() == 0
    # the greedy requests of the same batch all emit the greedy path, whatever their seed
    path = np.unravel_index(int(np.argmax(exact_joint(GREEDY))), (V, V, V))
    assert exact_joint(GREEDY).max() == 1.0
    np.testing.assert_array_equal(greedy, np.broadcast_to(np.array(path), greedy.shape))


def test_negative_controls_fail_the_check():
    """The TV test has power: lossy verification rules are detected."""
    # sampled drafts, but the verifier gets a q other than the one sampled from (B61)
    tv, *_ = run_tv(SETTINGS["t1_p0.9_k4_minp"], K=3, draft_sampling=True, distort_q=True)
    assert tv > 0.03, tv
    # FastDeploy's top-p candidate-set rule is not distribution preserving
    tv, *_ = run_tv(SETTINGS["t0.8_p0.9"], K=3, draft_sampling=True, strategy="topp")
    assert tv > 0.03, tv
