"""The Llama-family decoder and MTP head as Flax NNX modules.

Every parameter is an ``nnx.Param`` created with its logical axis names (:mod:`jmtp.model.axes`)
as ``out_sharding`` metadata; layer stacks are created directly stacked, the ``layers`` axis
first, so the target's L layers (and the head's N MTP modules) run under one ``lax.scan`` and
compile time does not grow with depth.

The math lives in the pure functions of :mod:`jmtp.model.llama`; each module's ``__call__``
runs them on :meth:`to_params`, the nested parameter dict they take (layout documented there).
That dict is a view built at trace time: inside ``jax.jit`` the module (``nnx.merge`` of the
state passed in) and the dict name the same arrays, so the jitted engine step compiles to the
same graph as before the modules existed. :meth:`LlamaForCausalLM.from_params` fills a module
from such a dict (what the GGUF / HF / MTP-head loaders produce) without random initialisation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model import llama, schema
from jmtp.model.config import ModelConfig
from jmtp.model.metadata import AttentionMetadata
from jmtp.model.quant import QuantizedWeight, logits_from_rows
# Buffer and the Param constructors live in jmtp.model.variables (shared with jmtp.model.moe).
from jmtp.model.variables import Buffer  # noqa: F401
from jmtp.model.variables import buffer as _buffer
from jmtp.model.variables import new_weight, own_variables


def _values(tree):
    """Replace every ``nnx.Variable`` of a nested dict / tuple with its array."""
    return jax.tree_util.tree_map(lambda v: v.get_value(), tree,
                                  is_leaf=lambda x: isinstance(x, nnx.Variable))


def _fill(variables, arrays, where: str) -> None:
    """Set each Variable of ``variables`` (nested dict / tuple) to the array at the same place of
    ``arrays``; raises ``ValueError`` naming the first tensor missing or of the wrong shape, or
    an 8-bit weight where the module has a float one (or the reverse, or another storage dtype
    or block: ``ModelConfig.quantization`` decides)."""
    if isinstance(variables, QuantizedWeight) or isinstance(arrays, QuantizedWeight):
        if not (isinstance(variables, QuantizedWeight) and isinstance(arrays, QuantizedWeight)):
            raise ValueError(
                f"{where}: {'an 8-bit' if isinstance(arrays, QuantizedWeight) else 'a float'} "
                f"weight given where ModelConfig.quantization makes it "
                f"{'8-bit' if isinstance(variables, QuantizedWeight) else 'float'}")
        if tuple(arrays.block) != tuple(variables.block) or arrays.dtype != variables.dtype:
            raise ValueError(f"{where}: {arrays.dtype} in blocks {tuple(arrays.block)}, expected "
                             f"{variables.dtype} in blocks {tuple(variables.block)}")
        _fill(variables.value, arrays.value, f"{where}.value")
        _fill(variables.scale, arrays.scale, f"{where}.scale")
        return
    if isinstance(variables, nnx.Variable):
        if tuple(arrays.shape) != tuple(variables.shape):
            raise ValueError(f"{where}: shape {tuple(arrays.shape)}, expected {variables.shape}")
        variables.set_value(arrays)
        return
    items = enumerate(variables) if isinstance(variables, (list, tuple)) else variables.items()
    for k, v in items:
        if isinstance(variables, dict) and k not in arrays:
            raise ValueError(f"missing tensor {where}.{k}")
        _fill(v, arrays[k], f"{where}.{k}" if where else str(k))


class Attention(nnx.Module):
    """Attention projections (MLA ones, :func:`jmtp.model.schema.attention_shapes`, when
    ``cfg.attention_type == "mla"``). GQA: ``wq f[H, Nq·D]``, ``wk, wv f[H, Nkv·D]``, ``wo f[Nq·D, H]``,
    Qwen2 biases ``bq, bk, bv`` when ``cfg.attention_bias``, Qwen3 ``q_norm, k_norm f[D]`` when
    ``cfg.qk_norm``; each with a leading ``layers`` axis of size ``num_stacked`` if given. The
    projections ``cfg.quantization`` covers under ``prefix`` (``"layers"``, ``"mtp.layer"``) are
    :class:`~jmtp.model.quant.QuantizedWeight` s."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_stacked: int | None = None, std: float = 0.02, prefix: str = "layers"):
        for name, shape in schema.attention_shapes(cfg).items():
            setattr(self, name, new_weight(cfg, name, shape, rngs=rngs, dtype=dtype, std=std,
                                           num_stacked=num_stacked, prefix=prefix))

    def variables(self) -> dict:
        """``{name: nnx.Param or QuantizedWeight}`` under the names of :mod:`jmtp.model.llama`'s
        layer dict."""
        return own_variables(self)


class GatedDeltaNet(nnx.Module):
    """The gated-DeltaNet token mixer of a hybrid model's linear-attention layer
    (:mod:`jmtp.model.gated_deltanet`; names and shapes in
    :func:`~jmtp.model.schema.linear_attention_shapes`), with a leading ``layers`` axis of
    size ``num_stacked`` if given. Initialised as transformers does up to ``A``'s range:
    ``A_log = 0``, ``dt_bias = 1``, norm weight 1."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_stacked: int | None = None, std: float = 0.02, prefix: str = "layers"):
        for name, shape in schema.linear_attention_shapes(cfg).items():
            setattr(self, name, new_weight(cfg, name, shape, rngs=rngs, dtype=dtype, std=std,
                                           num_stacked=num_stacked, prefix=prefix))

    def variables(self) -> dict:
        return own_variables(self)


class MLP(nnx.Module):
    """SwiGLU MLP: ``w_gate, w_up f[H, I]``, ``w_down f[I, H]`` (leading ``layers`` axis if
    ``num_stacked``; 8-bit where ``cfg.quantization`` covers ``prefix.<name>``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_stacked: int | None = None, std: float = 0.02, prefix: str = "layers"):
        for name, shape in schema.mlp_shapes(cfg).items():
            setattr(self, name, new_weight(cfg, name, shape, rngs=rngs, dtype=dtype, std=std,
                                           num_stacked=num_stacked, prefix=prefix))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``f[T, H] -> f[T, H]`` (unstacked MLP only)."""
        from jmtp.model.moe import swiglu
        return swiglu(x, *(_values(getattr(self, k)) for k in ("w_gate", "w_up", "w_down")))

    def variables(self) -> dict:
        return own_variables(self)


class DecoderLayer(nnx.Module):
    """Pre-norm Llama block: ``attn_norm f[H]``, :class:`Attention` (or with ``linear=True`` a
    hybrid model's :class:`GatedDeltaNet`), ``mlp_norm f[H]``, and the
    FFN: :class:`MLP`, or with ``moe=True`` the :class:`jmtp.model.moe.MoE` block of ``cfg.moe``.
    With ``num_stacked=L`` every parameter carries a leading ``layers`` axis of size L: the stack
    of L layers :func:`jmtp.model.llama.forward` scans over."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_stacked: int | None = None, std: float = 0.02, moe: bool = False,
                 linear: bool = False, prefix: str = "layers"):
        from jmtp.model.moe import MoE
        shapes = schema.layer_shapes(cfg, moe, linear)
        kw = dict(rngs=rngs, dtype=dtype, std=std, num_stacked=num_stacked, prefix=prefix)
        self.num_stacked = num_stacked
        self.attn_norm = new_weight(cfg, "attn_norm", shapes["attn_norm"], **kw)
        self.attn = (GatedDeltaNet if linear else Attention)(cfg, **kw)
        self.mlp_norm = new_weight(cfg, "mlp_norm", shapes["mlp_norm"], **kw)
        self.mlp = (MoE if moe else MLP)(cfg, rngs=rngs, dtype=dtype, num_stacked=num_stacked,
                                         std=std, prefix=prefix)

    def variables(self) -> dict:
        """The layer dict of :mod:`jmtp.model.llama` (``attn_norm, wq, …, w_down``) of Params."""
        return {"attn_norm": self.attn_norm, "mlp_norm": self.mlp_norm,
                **self.attn.variables(), **self.mlp.variables()}

    def to_params(self) -> dict:
        """``{name: array}``: one layer's dict, or the stacked ``f[L, ...]`` dict."""
        return _values(self.variables())


class DecoderStack(nnx.Module):
    """The target's L decoder layers: one stacked :class:`DecoderLayer` (``stacked=True``, run
    under one ``lax.scan``) or an ``nnx.List`` of L unstacked layers (run as an unrolled loop, see
    :func:`jmtp.model.llama.unstack_layers`). Layer ``i`` has the MoE FFN when
    ``cfg.is_moe_layer(i)``; a stack mixing dense and MoE layers cannot be stacked.

    Raises:
      ValueError: ``stacked=True`` for a model mixing dense and MoE layers."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 stacked: bool = True, std: float = 0.02):
        self.stacked = stacked
        kinds = schema.layer_kinds(cfg)
        if stacked:
            if len(set(kinds)) > 1:
                raise ValueError("a model mixing dense and MoE layers, or attention and linear-"
                                 "attention layers, cannot be stacked (ModelConfig.moe.layers / "
                                 "layer_types)")
            self.layers = DecoderLayer(cfg, rngs=rngs, dtype=dtype, num_stacked=cfg.num_layers,
                                       std=std, moe=kinds[0][0], linear=kinds[0][1])
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype, std=std, moe=m,
                                                 linear=lin) for m, lin in kinds])

    def variables(self):
        if self.stacked:
            return self.layers.variables()
        return tuple(layer.variables() for layer in self.layers)

    def to_params(self):
        """Stacked ``{name: f[L, ...]}`` or a tuple of L per-layer dicts."""
        return _values(self.variables())


class MTPHead(nnx.Module):
    """N stacked MTP modules (the DeepSeek-V3 report's multi-token prediction): ``enorm, hnorm,
    final_norm f[N, H]``, ``eh_proj f[N, 2H, H]`` and a :class:`DecoderLayer` stacked N times
    (MoE FFN when ``cfg.mtp_is_moe``, GLM-4.5)."""

    def __init__(self, cfg: ModelConfig, num_modules: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 std: float = 0.02):
        kw = dict(rngs=rngs, dtype=dtype, std=std, num_stacked=num_modules, prefix="mtp")
        for name, shape in schema.mtp_shapes(cfg).items():   # enorm, hnorm, eh_proj, final_norm
            setattr(self, name, new_weight(cfg, name, shape, **kw))
        n = num_modules
        self.layer = DecoderLayer(cfg, rngs=rngs, dtype=dtype, num_stacked=n, std=std,
                                  moe=cfg.mtp_is_moe, prefix="mtp.layer")

    def variables(self) -> dict:
        """``params["mtp"]`` of :mod:`jmtp.model.llama`, of Params."""
        return {"enorm": self.enorm, "hnorm": self.hnorm, "eh_proj": self.eh_proj,
                "final_norm": self.final_norm, "layer": self.layer.variables()}

    def to_params(self) -> dict:
        """``params["mtp"]`` of :mod:`jmtp.model.llama` (same arrays): ``enorm, hnorm,
        final_norm f[N, H]``, ``eh_proj f[N, 2H, H]``, ``layer`` the stacked layer dict."""
        return _values(self.variables())

    @classmethod
    def from_params(cls, cfg: ModelConfig, mtp: dict) -> "MTPHead":
        """A head holding the arrays of ``mtp`` (``params["mtp"]``, as :meth:`to_params` returns
        it, e.g. from :func:`jmtp.model.checkpoints.mtp_head.load_mtp_head`), without random initialisation.

        N comes from ``mtp["enorm"].shape[0]``, the dtype from ``mtp["enorm"]`` (arrays keep
        their own dtype); ``cfg`` decides which layer tensors exist (biases, q/k norms).

        Raises:
          ValueError: a tensor missing, of the wrong shape, or one the head of ``cfg`` has no
            place for (e.g. ``layer.bq`` without ``cfg.attention_bias``).
        """
        for need in ("enorm", "eh_proj", "layer"):
            if need not in mtp:
                raise ValueError(f"missing tensor mtp.{need}")
        n = int(mtp["enorm"].shape[0])
        head = nnx.eval_shape(lambda: cls(cfg, n, rngs=nnx.Rngs(0), dtype=mtp["enorm"].dtype))
        variables = head.variables()
        extra = sorted(set(mtp) - set(variables)) + sorted(
            f"layer.{k}" for k in set(mtp["layer"]) - set(variables["layer"]))
        if extra:
            raise ValueError(f"mtp: unexpected tensors {extra} for this model configuration")
        _fill(variables, mtp, "mtp")
        return head


class DraftHead(nnx.Module):
    """FR-Spec draft LM head (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language
    Models via Frequency-Ranked Speculative Sampling"): the MTP head scores only the N most frequent
    tokens.

    Attributes (both :class:`Buffer`, derived at load time, never trained):
      token_ids: i32[N]  full-vocabulary id of each draft-vocabulary entry (axis ``vocab``).
      weight: f[N, H]    their LM-head rows (axes ``vocab, embed``); with an int8 embedding a
        per-row :class:`~jmtp.model.quant.QuantizedWeight` (``i8[N, H]`` values, ``f32[N, 1]``
        scales: the table's own rows, :func:`jmtp.model.quant.take_rows`).

    Raises:
      ValueError: ``token_ids`` not 1-D integer, or ``weight`` not ``[len(token_ids), H]``.
    """

    def __init__(self, token_ids: jax.Array, weight):
        if token_ids.ndim != 1 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise ValueError(f"DraftHead.token_ids must be an integer vector, got "
                             f"{token_ids.dtype}{list(token_ids.shape)}")
        if weight.ndim != 2 or weight.shape[0] != token_ids.shape[0]:
            raise ValueError(f"DraftHead.weight must be [N={token_ids.shape[0]}, H], got "
                             f"{list(weight.shape)}")
        self.token_ids = _buffer(token_ids, schema.TOP_AXES["draft_ids"])
        if isinstance(weight, QuantizedWeight):
            self.weight = nnx.data(QuantizedWeight(
                _buffer(weight.value, schema.TOP_AXES["draft_head"]),
                _buffer(weight.scale, (schema.TOP_AXES["draft_head"][0], None)), weight.block))
        else:
            self.weight = _buffer(weight, schema.TOP_AXES["draft_head"])

    def __call__(self, h: jax.Array) -> jax.Array:
        """``f32[T, N]`` draft-vocabulary logits of post-norm hidden rows ``h f[T, H]``."""
        if isinstance(self.weight, QuantizedWeight):
            return logits_from_rows(h, _values(self.weight))
        return jnp.dot(h, self.weight[...].T, preferred_element_type=jnp.float32)

    def to_vocab(self, draft_tokens: jax.Array, probs: jax.Array | None, vocab_size: int):
        """Map draft-vocabulary picks back to the full vocabulary.

        Args:
          draft_tokens: i32[A] indices into the draft vocabulary.
          probs: f32[A, N] their distribution, or None.
          vocab_size: V.

        Returns:
          ``(i32[A] full-vocabulary ids, f32[A, V] with q = 0 off the N tokens, or None)``.
        """
        ids = self.token_ids[...]
        tokens = ids[draft_tokens]
        if probs is not None:
            probs = jnp.zeros((probs.shape[0], vocab_size), probs.dtype).at[:, ids].set(probs)
        return tokens, probs


class LlamaForCausalLM(nnx.Module):
    """Llama-family target (Llama, Qwen2, Qwen3) with an optional MTP head and FR-Spec buffers.

    Attributes: ``embed f[V, H]``, ``lm_head f[H, V]`` (None when tied), ``final_norm f[H]``,
    ``layers`` (:class:`DecoderStack`), ``mtp`` (:class:`MTPHead` or None), and the
    FR-Spec's token ranking ``draft_vocab i32[V]`` (a :class:`Buffer`, from an MTP head file; None
    unless set), the int8 KV cache's key shift ``k_shift f32[L, Nkv, D]`` (a :class:`Buffer`,
    :mod:`jmtp.model.kv_shift`; None unless set) and ``draft_head`` (a :class:`DraftHead` derived from it at load time, or None:
    drafts are then scored over the full vocabulary). ``cfg`` is static (part of the graph definition).

    Args:
      cfg: the model configuration.
      rngs: random streams for the initial weights (matrices N(0, std²), norms 1).
      dtype: parameter dtype.
      num_mtp: MTP modules (default ``cfg.num_mtp_layers``; 0 = no head).
      stacked: layers stacked on a leading ``layers`` axis (one ``lax.scan``) or a list.
      lm_head: with a separate LM head (default: ``not cfg.tie_word_embeddings``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 num_mtp: int | None = None, stacked: bool = True, lm_head: bool | None = None,
                 std: float = 0.02):
        self.cfg = cfg
        lm_head = not cfg.tie_word_embeddings if lm_head is None else lm_head
        # int8: embed per vocabulary row, lm_head per output channel (cfg.quantization)
        shapes = schema.top_shapes(cfg.replace(tie_word_embeddings=not lm_head))
        kw = dict(rngs=rngs, dtype=dtype, std=std, prefix="")
        self.embed = new_weight(cfg, "embed", shapes["embed"], **kw)
        self.lm_head = (new_weight(cfg, "lm_head", shapes["lm_head"], **kw) if lm_head
                        else nnx.data(None))
        self.final_norm = new_weight(cfg, "final_norm", shapes["final_norm"], **kw)
        self.layers = DecoderStack(cfg, rngs=rngs, dtype=dtype, stacked=stacked, std=std)
        n = cfg.num_mtp_layers if num_mtp is None else num_mtp
        self.mtp = nnx.data(MTPHead(cfg, n, rngs=rngs, dtype=dtype, std=std) if n else None)
        self.draft_vocab = nnx.data(None)   # Buffer, set by set_buffer
        self.draft_head = nnx.data(None)    # DraftHead, set by set_draft_head
        self.k_shift = nnx.data(None)       # Buffer, set by set_buffer

    # -- the parameter dict of jmtp.model.llama ------------------------------------------------
    def variables(self) -> dict:
        """The nested dict of :mod:`jmtp.model.llama` with Variables as leaves (absent entries
        left out)."""
        out = {"embed": self.embed, "final_norm": self.final_norm,
               "layers": self.layers.variables()}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        if self.mtp is not None:
            out["mtp"] = self.mtp.variables()
        if self.draft_vocab is not None:
            out["draft_vocab"] = self.draft_vocab
        if self.draft_head is not None:
            out["draft_ids"] = self.draft_head.token_ids
            out["draft_head"] = self.draft_head.weight
        if self.k_shift is not None:
            out["k_shift"] = self.k_shift
        return out

    def to_params(self) -> dict:
        """The parameter dict the pure functions of :mod:`jmtp.model.llama` take (same arrays)."""
        return _values(self.variables())

    def set_buffer(self, name: str, value: jax.Array | None) -> None:
        """Set (or with None remove) the :class:`Buffer` ``draft_vocab`` (FR-Spec token ranking
        ``i32[V]``) or ``k_shift`` (int8 KV caches' key shift ``f32[L, Nkv, D]``,
        :mod:`jmtp.model.kv_shift`). Raises ``ValueError`` for another name."""
        if name not in ("draft_vocab", "k_shift"):
            raise ValueError(f"unknown buffer {name!r} (draft_ids / draft_head: set_draft_head)")
        setattr(self, name, nnx.data(None if value is None else _buffer(value, schema.TOP_AXES[name])))

    def set_draft_head(self, token_ids: jax.Array | None, weight: jax.Array | None = None) -> None:
        """Set the FR-Spec :class:`DraftHead` (``token_ids i32[N]``, ``weight f[N, H]``), or with
        ``token_ids=None`` remove it. Raises ``ValueError`` as :class:`DraftHead`."""
        self.draft_head = nnx.data(None if token_ids is None else DraftHead(token_ids, weight))

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict) -> "LlamaForCausalLM":
        """A module holding the arrays of ``params`` (the dict of :mod:`jmtp.model.llama`, e.g. from
        :func:`jmtp.model.load_checkpoint`), without random initialisation (``nnx.eval_shape``).

        The MTP head is built if ``params`` has ``"mtp"`` (its N from ``mtp.enorm``), the LM head
        if it has ``"lm_head"`` (as :func:`jmtp.model.llama.compute_logits` decides); unstacked
        layers (a tuple of dicts) give an unstacked :class:`DecoderStack`. Arrays keep their dtype.

        Raises:
          ValueError: a tensor missing, of the wrong shape, or an unknown top-level key.
        """
        extra = set(params) - {"embed", "lm_head", "final_norm", "layers", "mtp", "draft_vocab",
                               "draft_ids", "draft_head", "k_shift"}
        if extra:
            raise ValueError(f"params: unknown entries {sorted(extra)}")
        n = int(params["mtp"]["enorm"].shape[0]) if "mtp" in params else 0
        stacked = not isinstance(params["layers"], (list, tuple))
        dtype = llama.param_dtype(params)
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, num_mtp=n,
                                           stacked=stacked, lm_head="lm_head" in params))
        bufs = ("draft_vocab", "draft_ids", "draft_head", "k_shift")
        core = {k: v for k, v in params.items() if k not in bufs}
        _fill({k: v for k, v in model.variables().items() if k in core}, core, "")
        for name in ("draft_vocab", "k_shift"):
            if name in params:
                model.set_buffer(name, params[name])
        if ("draft_ids" in params) != ("draft_head" in params):
            raise ValueError("params: draft_ids and draft_head come together (FR-Spec draft head)")
        if "draft_ids" in params:
            model.set_draft_head(params["draft_ids"], params["draft_head"])
        return model

    # -- forward passes (the pure functions of jmtp.model.llama on this module's arrays) -------
    def __call__(self, ids: jax.Array, positions: jax.Array, meta: AttentionMetadata,
                 cache: llama.KVCache, attention_impl: str | None = None):
        """Target forward over a packed ragged batch (``ids, positions i32[T]``): returns
        ``(hidden f[T, H], cache with this step's K/V)``; see :func:`jmtp.model.llama.forward`.
        ``hidden`` is the state the MTP head takes: post-final-norm, or pre-norm when
        ``cfg.mtp_takes_prenorm_hidden`` (MiMo). :meth:`target_logits` scores it either way."""
        return llama.forward(self.cfg, self.to_params(), ids, positions, meta, cache, attention_impl,
                             pre_norm=self.cfg.mtp_takes_prenorm_hidden)

    def logits(self, h: jax.Array) -> jax.Array:
        """``f32[T, V]`` logits of post-norm hidden states ``h f[T, H]`` (the target's final norm
        or an MTP module's)."""
        return llama.compute_logits(self.to_params(), h, self.cfg.batch_invariant)

    def target_logits(self, hidden: jax.Array) -> jax.Array:
        """``f32[T, V]`` logits of rows ``hidden f[T, H]`` of :meth:`__call__`'s output: the final
        norm first when those rows are pre-norm (``cfg.mtp_takes_prenorm_hidden``)."""
        if self.cfg.mtp_takes_prenorm_hidden:
            hidden = llama.final_norm(self.cfg, self.to_params(), hidden)
        return self.logits(hidden)

    def mtp_forward(self, layer_idx, ids, hidden, positions, meta, cache, attention_impl=None):
        """One MTP module; see :func:`jmtp.model.llama.mtp_forward`. Raises ``ValueError``
        without an MTP head."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head")
        return llama.mtp_forward(self.cfg, self.to_params(), layer_idx, ids, hidden, positions,
                                 meta, cache, attention_impl)


MODULE_CLASSES = (Attention, GatedDeltaNet, MLP, DecoderLayer, DecoderStack, MTPHead, DraftHead, LlamaForCausalLM)
