"""The parameter schema (:mod:`jmtp.model.schema`) against everything that states a parameter's
shape or axes: a real checkpoint's tensors, the NNX modules' Params, and an abstract engine's
parameters with their shardings on a TPU mesh. Each check also pins a few values worked out by
hand from the published model sizes, so the schema cannot agree with itself by construction."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmtp.model import LlamaForCausalLM, init_params, schema
from jmtp.model.config import LinearAttentionConfig, ModelConfig, MoEConfig


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _shapes(tree) -> dict:
    return {k: tuple(v.shape) for k, v in _flat(tree).items()}


def _is_entry(x) -> bool:   # a TensorSpec, a shape or an axes tuple (not a tuple of layers)
    return isinstance(x, schema.TensorSpec) or (
        isinstance(x, tuple) and not any(isinstance(e, dict) for e in x))


def _schema_flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v
            for k, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_entry)}


PARAMS = ("embed", "lm_head", "final_norm", "layers", "mtp")   # the rest are buffers


def test_real_checkpoint_has_the_schemas_shapes(smollm2):
    """SmolLM2-135M loaded from its GGUF: every tensor the loader made is one the schema names,
    of the schema's shape, and the published sizes (V 49152, H 576, 30 layers, 9 query / 3 kv
    heads of 64, I 1536, tied embedding) come out where they should."""
    cfg, params = smollm2
    loaded = _shapes({k: v for k, v in params.items() if k in PARAMS})
    assert loaded == _schema_flat(schema.param_shapes(cfg))
    assert loaded["['embed']"] == (49152, 576) and "['lm_head']" not in loaded
    assert loaded["['layers']['wq']"] == (30, 576, 9 * 64)
    assert loaded["['layers']['wk']"] == (30, 576, 3 * 64)
    assert loaded["['layers']['w_down']"] == (30, 1536, 576)


def test_modules_carry_the_schemas_axes(smollm2):
    """The NNX module holding the checkpoint: each Param's logical axes are the schema's."""
    cfg, params = smollm2
    model = LlamaForCausalLM.from_params(cfg, params)
    variables = {k: v for k, v in model.variables().items() if k in PARAMS}
    axes = jax.tree_util.tree_map(lambda v: v.get_metadata()["out_sharding"], variables,
                                  is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert _schema_flat(axes) == _schema_flat(schema.param_axes(cfg))
    assert schema.param_axes(cfg)["layers"]["wk"] == ("layers", "embed", "kv_heads")


MOE = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=128, num_mtp_layers=1,
                  moe=MoEConfig(8, 2, 64, layers=(1, 2), mtp_moe=True, score_bias=True,
                                scoring="sigmoid", shared_intermediate_size=64))


def test_abstract_engine_params_and_shardings_follow_the_schema():
    """An abstract engine (no arrays) of a dense-then-MoE model with an MoE MTP layer on a
    compile-only v5e:2x2 slice, data 2 × model 2 with expert parallelism: every parameter has the
    schema's shape and dtype rule (router biases f32 in a bf16 model), and the sharding its
    schema axes give under the expert-parallel rules; by hand: query columns over ``model``,
    the routed experts over both axes, the router replicated."""
    from jmtp import aot
    from jmtp.core.mesh import mesh_rules
    from jmtp.runtime.config import SpeculativeConfig
    from jmtp.runtime.host.engine_args import EngineArgs
    from jmtp.runtime.device.sharding import logical_spec

    runner = EngineArgs(
        model_config=MOE, max_num_seqs=4, max_model_len=256, data_parallel_size=2,
        tensor_parallel_size=2, enable_expert_parallel=True, abstract=True,
        devices=aot.topology_devices("v5e:2x2"),
        speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=2),
    ).build().runner
    got = _flat(nnx.merge(runner.graphdef, runner.params).to_params())
    specs = _schema_flat(schema.param_specs(MOE))
    assert set(got) == set(specs)
    mesh, rules = runner.params["embed"].get_value().sharding.mesh, mesh_rules(True)
    for path, spec in specs.items():
        a = got[path]
        assert tuple(a.shape) == spec.shape, path
        assert a.dtype == spec.dtype(jnp.bfloat16), path
        assert a.sharding.spec == logical_spec(spec.axes, spec.shape, mesh, path, rules), path
    assert got["['layers'][0]['wq']"].sharding.spec == P(None, "model")
    assert got["['layers'][1]['experts_gate']"].sharding.spec == P(("data", "model"), None, None)
    assert got["['mtp']['layer']['router']"].sharding.spec == P(None, None, None)
    assert got["['layers'][2]['router_bias']"].dtype == jnp.float32


HYBRID = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, num_mtp_layers=1,
                     layer_types=("linear_attention", "full_attention", "linear_attention"),
                     linear=LinearAttentionConfig(2, 4, 8, 8, 4), attn_output_gate=True,
                     qk_norm=True)
MLA = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=8, attention_type="mla", q_lora_rank=16,
                  kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=20,
                  num_mtp_layers=1)


@pytest.mark.parametrize("cfg", [MOE, HYBRID, MLA], ids=["moe", "hybrid", "mla"])
def test_init_params_modules_and_abstract_params_agree(cfg):
    """The three trees made from the schema (random ``init_params``, the NNX module's Params,
    ``abstract_params``) have the same leaves and shapes, and a few shapes worked by hand."""
    init = _shapes(init_params(cfg, jax.random.key(0)))
    module = _shapes(nnx.eval_shape(lambda: LlamaForCausalLM(
        cfg, rngs=nnx.Rngs(0), stacked=schema.layers_stacked(cfg))).to_params())
    abstract = _shapes(schema.abstract_params(cfg, jnp.float32))
    assert init == module == abstract
    if cfg is HYBRID:   # Hk·Dk = 2·8, Hv·Dv = 4·8, conv kernel 4
        assert init["['layers'][0]['lin_q']"] == (32, 16)
        assert init["['layers'][0]['conv_v']"] == (4, 32)
        assert init["['layers'][1]['wg']"] == (32, 32)
    if cfg is MLA:      # wq_b: Rq × Nq·(dn + dr) = 16 × 4·16; wkv_b: C × Nq·(dn + dv) = 12 × 4·28
        assert init["['layers']['wq_b']"] == (2, 16, 64)
        assert init["['layers']['wkv_b']"] == (2, 12, 112)
        assert init["['mtp']['eh_proj']"] == (1, 64, 32)


def test_initial_values_follow_the_leaf_rules():
    """Norms start at one, the score-correction bias at zero in f32 whatever the dtype, the
    MTP projection at N(0, 1/2H); an unknown name or a random leaf without a key is refused."""
    assert float(schema.initial_value("attn_norm", (4,), jnp.bfloat16).sum()) == 4.0
    bias = schema.initial_value("router_bias", (8,), jnp.bfloat16)
    assert bias.dtype == jnp.float32 and not bias.any()
    eh = schema.initial_value("eh_proj", (1, 512, 256), jnp.float32, key=jax.random.key(0))
    assert abs(float(eh.std()) - 512 ** -0.5) < 0.05 * 512 ** -0.5
    with pytest.raises(ValueError, match="unknown parameter 'wqq'"):
        schema.initial_value("wqq", (4,), jnp.float32)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        schema.initial_value("wq", (4, 4), jnp.float32)
