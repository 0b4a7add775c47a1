"""MoE feed-forward (jmtp.model.moe) against transformers' own MoE blocks (Qwen3-MoE, GLM-4.5,
ERNIE-4.5-MoE, torch CPU, fp32): routing (chosen experts and weights) and the block output, for
both implementations (dense reference and ragged_dot); the two agree with each other under jit;
the NNX module carries the ``experts`` logical axis; bad configurations raise ValueError."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmtp.model import axes as ax
from jmtp.model.config import ModelConfig, MoEConfig
from jmtp.model.moe import MoE, experts_dense, experts_ragged, moe_ffn, route

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

H, IE, T = 32, 16, 24


def _families():
    """(name, HF block, our MoEConfig) with random weights, biases that change the choice."""
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as em
    from transformers.models.glm4_moe import modeling_glm4_moe as gm
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm
    common = dict(hidden_size=H, moe_intermediate_size=IE, intermediate_size=48)
    out = []
    for norm in (False, True):
        c = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3,
                                        norm_topk_prob=norm)
        out.append((f"qwen3_norm{int(norm)}", qm.Qwen3MoeSparseMoeBlock(c),
                    MoEConfig(8, 3, IE, norm_topk_prob=norm)))
    c = transformers.Glm4MoeConfig(**common, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                                   norm_topk_prob=True)
    out.append(("glm", gm.Glm4MoeMoE(c),
                MoEConfig(16, 4, IE, scoring="sigmoid", norm_topk_prob=True, score_bias=True,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          shared_intermediate_size=2 * IE)))
    c = transformers.Ernie4_5_MoeConfig(**common, moe_num_experts=8, moe_k=2,
                                        moe_num_shared_experts=1, moe_norm_min=1e-12)
    out.append(("ernie", em.Ernie4_5_MoeSparseMoeBlock(c),
                MoEConfig(8, 2, IE, scoring="softmax", norm_topk_prob=True, norm_min=1e-12,
                          score_bias=True, shared_intermediate_size=IE)))
    return out


FAMILIES = _families()


def _randomize(block, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in block.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in block.named_parameters():   # ERNIE's bias is a Parameter
            if "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _params(block, moe: MoEConfig) -> dict:
    """jmtp layer dict (``[in, out]``) of an HF MoE block."""
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gu, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]      # [E, 2I, H], [E, H, I]
    p = {"router": sd["gate.weight"].T,
         "experts_gate": gu[:, :IE].transpose(0, 2, 1), "experts_up": gu[:, IE:].transpose(0, 2, 1),
         "experts_down": down.transpose(0, 2, 1)}
    bias = [v for k, v in sd.items() if k.endswith("e_score_correction_bias")]
    if moe.score_bias:
        p["router_bias"] = bias[0].reshape(-1)
    if moe.shared_intermediate_size:
        p.update(shared_gate=sd["shared_experts.gate_proj.weight"].T,
                 shared_up=sd["shared_experts.up_proj.weight"].T,
                 shared_down=sd["shared_experts.down_proj.weight"].T)
    return {k: jnp.asarray(v) for k, v in p.items()}


@pytest.fixture(scope="module", params=range(len(FAMILIES)), ids=[f[0] for f in FAMILIES])
def family(request):
    name, block, moe = FAMILIES[request.param]
    _randomize(block, request.param)
    block.eval()
    x = np.random.default_rng(request.param).standard_normal((1, T, H)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()[0]
        _, w_hf, ids_hf = block.gate(torch.from_numpy(x[0]))
    gates_hf = np.zeros((T, moe.num_experts), np.float32)
    np.put_along_axis(gates_hf, ids_hf.numpy(), w_hf.numpy(), axis=1)
    return moe, _params(block, moe), x[0], want, gates_hf


def test_routing_matches_transformers(family):
    moe, p, x, _, gates_hf = family
    weights, ids = route(moe, jnp.asarray(x), p["router"], p.get("router_bias"))
    gates = np.zeros_like(gates_hf)
    np.put_along_axis(gates, np.asarray(ids), np.asarray(weights), axis=1)
    np.testing.assert_array_equal(gates > 0, gates_hf > 0)        # the same experts chosen
    np.testing.assert_allclose(gates, gates_hf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_block_matches_transformers(family, impl):
    moe, p, x, want, _ = family
    got = jax.jit(lambda p, x: moe_ffn(moe, p, x, impl))(p, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_bias_changes_choice_in_glm_case():
    """The correction bias decides the choice but is not part of the weights: without it the
    GLM case chooses other experts (so the test above exercises the bias)."""
    moe, p, x, _, gates_hf = _family_by_name("glm")
    _, ids = route(moe, jnp.asarray(x), p["router"], None)
    plain = np.zeros_like(gates_hf)
    np.put_along_axis(plain, np.asarray(ids), 1.0, axis=1)
    assert ((plain > 0) != (gates_hf > 0)).any()


def _family_by_name(name):
    i = [f[0] for f in FAMILIES].index(name)
    _, block, moe = FAMILIES[i]
    _randomize(block, i)
    x = np.random.default_rng(i).standard_normal((1, T, H)).astype(np.float32)
    with torch.no_grad():
        _, w_hf, ids_hf = block.gate(torch.from_numpy(x[0]))
    gates = np.zeros((T, moe.num_experts), np.float32)
    np.put_along_axis(gates, ids_hf.numpy(), w_hf.numpy(), axis=1)
    return moe, _params(block, moe), x[0], None, gates


def test_grouped_topk_hand_worked():
    """4 experts in 2 groups, topk_group=1, k=2, sigmoid scores given directly through logits.
    Group scores (top-2 sums): g0 = s0 + s1, g1 = s2 + s3; expert 2 alone is the best, but
    g0 wins, so the choice is {0, 1}."""
    moe = MoEConfig(4, 2, 4, scoring="sigmoid", n_group=2, topk_group=1)
    s = np.array([[0.6, 0.55, 0.9, 0.1]], np.float32)
    logits = np.log(s / (1 - s))                                      # sigmoid^-1
    x = jnp.eye(4, dtype=jnp.float32)[:1]                            # picks the router's row 0
    router = jnp.zeros((4, 4), jnp.float32).at[0].set(jnp.asarray(logits[0]))
    weights, ids = route(moe, x, router)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1]
    np.testing.assert_allclose(sorted(np.asarray(weights)[0]), [0.55, 0.6], rtol=1e-6)


def test_dense_and_ragged_agree_random():
    rng = np.random.default_rng(7)
    e, k, t = 6, 3, 37
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    wg, wu = (jnp.asarray(0.3 * rng.standard_normal((e, H, IE)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(0.3 * rng.standard_normal((e, IE, H)), jnp.float32)
    logits = rng.standard_normal((t, e))
    ids = jnp.asarray(np.argsort(-logits, 1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    a = jax.jit(experts_dense)(x, wg, wu, wd, weights, ids)
    b = jax.jit(experts_ragged)(x, wg, wu, wd, weights, ids)
    # independent numpy reference: loop over tokens and their chosen experts
    xn, idn, wn = np.asarray(x), np.asarray(ids), np.asarray(weights)
    ref = np.zeros((t, H), np.float64)
    for i in range(t):
        for j in range(k):
            ee = idn[i, j]
            g = xn[i] @ np.asarray(wg[ee])
            hid = g / (1 + np.exp(-g)) * (xn[i] @ np.asarray(wu[ee]))
            ref[i] += wn[i, j] * (hid @ np.asarray(wd[ee]))
    np.testing.assert_allclose(np.asarray(a), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(b), ref, rtol=1e-4, atol=1e-5)


def test_ragged_leaves_out_pairs_of_another_device():
    """Expert parallelism hands ``experts_ragged`` the pairs of experts another device owns as
    id ``E``: they contribute 0 (they sort last, outside every group), the others as before
    (numpy loop over the kept pairs)."""
    rng = np.random.default_rng(3)
    e, k, t = 4, 2, 9
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    wg, wu = (jnp.asarray(0.3 * rng.standard_normal((e, H, IE)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(0.3 * rng.standard_normal((e, IE, H)), jnp.float32)
    ids = np.stack([rng.permutation(e + 2)[:k] for _ in range(t)]).clip(0, e).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    got = np.asarray(jax.jit(experts_ragged)(x, wg, wu, wd, jnp.asarray(weights),
                                             jnp.asarray(ids)))
    assert (ids == e).any() and (ids < e).any()
    ref = np.zeros((t, H))
    for i in range(t):
        for j in range(k):
            if ids[i, j] < e:
                ee = ids[i, j]
                g = np.asarray(x[i]) @ np.asarray(wg[ee])
                hid = g / (1 + np.exp(-g)) * (np.asarray(x[i]) @ np.asarray(wu[ee]))
                ref[i] += weights[i, j] * (hid @ np.asarray(wd[ee]))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_auto_implementation_resolves_per_backend():
    from jmtp.model.moe import resolve_implementation
    assert resolve_implementation("auto") == ("ragged" if jax.default_backend() == "tpu" else "dense")
    assert resolve_implementation("ragged") == "ragged"
    with pytest.raises(ValueError, match="MoE implementation"):
        resolve_implementation("megablox")


def test_module_axes_and_call():
    cfg = ModelConfig(hidden_size=H, moe=MoEConfig(4, 2, IE, score_bias=True,
                                                   shared_intermediate_size=IE, layers=(1,)))
    m = MoE(cfg, rngs=nnx.Rngs(0))
    names = {k: v.get_metadata()["out_sharding"] for k, v in m.variables().items()}
    assert names["experts_gate"] == (ax.EXPERTS, ax.EMBED, ax.EXPERT_MLP)
    assert names["router"] == (ax.EMBED, None)       # replicated: every device routes its rows
    assert names["shared_down"] == (ax.MLP, ax.EMBED)
    stacked = MoE(cfg, rngs=nnx.Rngs(0), num_stacked=3)
    assert stacked.experts_down.get_metadata()["out_sharding"] == (
        ax.LAYERS, ax.EXPERTS, ax.EXPERT_MLP, ax.EMBED)
    assert stacked.experts_down[...].shape == (3, 4, IE, H)
    x = jnp.ones((5, H))
    np.testing.assert_allclose(np.asarray(m(x, "dense")), np.asarray(m(x, "ragged")),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, field", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(scoring="relu"), "scoring"),
    (dict(implementation="megablox"), "implementation"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(layers=(2, 1)), "layers"),
])
def test_moe_config_errors(kw, field):
    base = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    with pytest.raises(ValueError, match=field):
        MoEConfig(**{**base, **kw})
    with pytest.raises(ValueError, match="moe.layers"):
        ModelConfig(num_layers=2, moe=MoEConfig(**base, layers=(0, 2)))
