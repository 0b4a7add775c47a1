"""Model configuration: the static description of a Llama-family decoder and its MTP head.

A :class:`ModelConfig` is frozen and hashable, so it can be passed to ``jax.jit`` as a static
argument. Every shape of the parameter pytree (see :mod:`jmtp.model.params`) follows from it.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from jmtp.core.checks import check_one_of
from jmtp.model.quant import QuantConfig

MTP_LAYOUTS = ("deepseek", "ernie", "mimo", "qwen3_next")
ATTENTION_TYPES = ("gqa", "mla")
MLA_PATHS = ("absorbed", "expanded")
MOE_SCORING = ("softmax", "sigmoid")
MOE_IMPLEMENTATIONS = ("auto", "ragged", "dense")
#: Token dispatch of expert parallelism (vLLM's ``all2all_backend`` option;
#: :mod:`jmtp.model.expert_parallel`).
ALL2ALL_BACKENDS = ("auto", "allgather_reducescatter", "ragged_all_to_all")
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet token mixer of a hybrid model's ``"linear_attention"`` layers (Yang, Kautz &
    Hatamizadeh 2024, arXiv 2412.06464; Qwen3-Next / Qwen3.5, transformers
    ``Qwen3NextGatedDeltaNet``), :mod:`jmtp.model.gated_deltanet`.

    Attributes:
      num_key_heads: Hk query/key heads (HF ``linear_num_key_heads``).
      num_value_heads: Hv value heads (``linear_num_value_heads``), a multiple of Hk: key head
        ``h`` serves value heads ``[h·Hv/Hk, (h+1)·Hv/Hk)``.
      key_head_dim: Dk (``linear_key_head_dim``).
      value_head_dim: Dv (``linear_value_head_dim``).
      conv_kernel_dim: width of the depthwise causal convolution over ``[q; k; v]``
        (``linear_conv_kernel_dim``); its state holds the last ``conv_kernel_dim - 1`` inputs.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int = 4

    def __post_init__(self):
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LinearAttentionConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"LinearAttentionConfig.num_value_heads ({self.num_value_heads}) "
                             f"must be a multiple of num_key_heads ({self.num_key_heads})")
        if self.conv_kernel_dim < 2:
            raise ValueError(f"LinearAttentionConfig.conv_kernel_dim must be >= 2, got "
                             f"{self.conv_kernel_dim}")

    @property
    def key_dim(self) -> int:
        """``Hk·Dk``: width of the query and of the key projection."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """``Hv·Dv``: width of the value and output-gate projections."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: ``[q; k; v]``, ``2·Hk·Dk + Hv·Dv``."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3 style (``rope_type == "llama3"`` in HF configs) or YaRN
    (``"yarn"``, Peng et al. 2023, arXiv 2309.00071; DeepSeek-V3's, HF ``_compute_yarn_parameters``).

    Attributes:
      factor: wavelength stretch for low frequencies.
      low_freq_factor / high_freq_factor: band edges, as in HF ``_compute_llama3_parameters``
        (llama3 only).
      original_max_position_embeddings: context length the base model was trained for.
      rope_type: ``"llama3"`` or ``"yarn"``.
      beta_fast / beta_slow: YaRN ramp boundaries (rotations), defaults 32 / 1.
      mscale / mscale_all_dim: YaRN attention-factor terms (0 = absent); DeepSeek's MLA also
        multiplies its softmax scale by ``(0.1 * mscale_all_dim * ln(factor) + 1)^2``.
      attention_factor: YaRN cos/sin multiplier; None = derived from factor and the mscales.
      truncate: YaRN rounds the correction range to whole dimensions (HF default True).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("llama3", "yarn"):
            raise ValueError(f"RopeScaling.rope_type must be 'llama3' or 'yarn', got "
                             f"{self.rope_type!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward of some layers (:mod:`jmtp.model.moe`).

    One router covers the gating of the supported families:

    * Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): ``scoring="softmax"``, no bias, ``norm_topk_prob``
      from the config, ``routed_scaling_factor=1``, no shared experts.
    * DeepSeek-V3 / GLM-4.5 (``Glm4MoeTopkRouter``): ``scoring="sigmoid"``,
      ``e_score_correction_bias`` added for the choice only, grouped top-k (``n_group``,
      ``topk_group``: keep the ``topk_group`` groups with the largest sum of their top-2 scores),
      ``norm_topk_prob`` (denominator ``sum + 1e-20``), ``routed_scaling_factor``,
      ``n_shared_experts``.
    * ERNIE-4.5-MoE (``Ernie4_5_MoeTopKRouter``): ``scoring="softmax"``, ``moe_statics``
      correction bias for the choice only, renormalised by ``max(sum, norm_min)``
      (``moe_norm_min``), ``moe_num_shared_experts``.

    Attributes:
      num_experts: E routed experts.
      num_experts_per_tok: k experts chosen per token (1 <= k <= E).
      moe_intermediate_size: I_e, each expert's SwiGLU width.
      layers: indices of the target layers whose FFN is the MoE block (the others are dense with
        ``ModelConfig.intermediate_size``): ``first_k_dense_replace`` (DeepSeek/GLM),
        ``moe_layer_start_index/_end_index/_interval`` (ERNIE), ``decoder_sparse_step`` /
        ``mlp_only_layers`` (Qwen3-MoE), resolved by the loader.
      mtp_moe: the MTP modules' FFN is the MoE block (GLM-4.5) or dense (ERNIE-4.5's MTP block).
      scoring: ``"softmax"`` or ``"sigmoid"`` router scores (computed in fp32).
      norm_topk_prob: renormalise the k chosen weights to sum 1.
      norm_min: with ``norm_topk_prob``, the denominator is ``max(sum, norm_min)`` when > 0
        (ERNIE), else ``sum + 1e-20`` (DeepSeek/GLM; Qwen3's plain sum up to 1e-20).
      score_bias: a per-expert correction bias ``f32[E]`` is added to the scores for the choice
        only (DeepSeek-V3 ``e_score_correction_bias``, ERNIE ``moe_statics``).
      n_group / topk_group: grouped top-k (DeepSeek-V3 node-limited routing); 1/1 = plain top-k.
      routed_scaling_factor: multiplies the routed experts' weights.
      shared_intermediate_size: SwiGLU width of the shared experts (``n_shared_experts ·
        moe_intermediate_size``), 0 = none; their output is added unweighted, or scaled by
        ``sigmoid(x · shared_expert_gate)`` with ``shared_expert_gate``.
      shared_expert_gate: the shared expert's output is gated per token by
        ``sigmoid(x @ shared_gate_proj f[H, 1])`` (Qwen3-Next / Qwen3.5-MoE
        ``shared_expert_gate``).
      implementation: ``"ragged"`` (tokens sorted by expert, ``jax.lax.ragged_dot``: grouped
        matmuls of k·T rows on TPU, whose XLA backend implements the op), ``"dense"`` (reference:
        every expert on every token, weighted; E·T rows) or ``"auto"`` (default: ``"ragged"`` on
        TPU, ``"dense"`` elsewhere: XLA:CPU lowers ``ragged_dot`` to a masked dense product over
        all E groups, k times the dense reference's work; ``scripts/bench_moe.py``).
      expert_parallel: on a device mesh, the routed experts are split over every device (data ×
        model) and each token is dispatched to the devices owning its experts and back
        (:mod:`jmtp.model.expert_parallel`; ``LLM(enable_expert_parallel=True)``). No effect on
        one device.
      all2all_backend: the dispatch under expert parallelism: ``"allgather_reducescatter"``,
        ``"ragged_all_to_all"`` or ``"auto"`` (resolved by the engine for its platform and mesh:
        :func:`jmtp.model.expert_parallel.resolve_all2all_backend`).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    layers: tuple[int, ...] = ()
    mtp_moe: bool = False
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    norm_min: float = 0.0
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    implementation: Literal["auto", "ragged", "dense"] = "auto"
    expert_parallel: bool = False
    all2all_backend: Literal["auto", "allgather_reducescatter", "ragged_all_to_all"] = "auto"

    def __post_init__(self):
        e, k = self.num_experts, self.num_experts_per_tok
        if e < 1 or self.moe_intermediate_size < 1:
            raise ValueError(f"MoEConfig.num_experts ({e}) and moe_intermediate_size "
                             f"({self.moe_intermediate_size}) must be >= 1")
        if not 1 <= k <= e:
            raise ValueError(f"MoEConfig.num_experts_per_tok must lie in [1, num_experts={e}], "
                             f"got {k}")
        check_one_of("MoEConfig.scoring", self.scoring, MOE_SCORING)
        check_one_of("MoEConfig.implementation", self.implementation, MOE_IMPLEMENTATIONS)
        check_one_of("MoEConfig.all2all_backend", self.all2all_backend, ALL2ALL_BACKENDS)
        if self.n_group < 1 or e % self.n_group:
            raise ValueError(f"MoEConfig.n_group ({self.n_group}) must be >= 1 and divide "
                             f"num_experts ({e})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"MoEConfig.topk_group must lie in [1, n_group={self.n_group}], got "
                             f"{self.topk_group}")
        if self.n_group > 1 and e // self.n_group < 2:
            raise ValueError(f"MoEConfig: grouped top-k scores a group by its top-2 experts, so "
                             f"num_experts / n_group must be >= 2 (got {e}/{self.n_group})")
        if self.n_group > 1 and k > self.topk_group * (e // self.n_group):
            raise ValueError(f"MoEConfig.num_experts_per_tok ({k}) exceeds the experts of the "
                             f"topk_group={self.topk_group} kept groups")
        if self.shared_intermediate_size < 0 or any(i < 0 for i in self.layers):
            raise ValueError("MoEConfig.shared_intermediate_size and layers must be >= 0")
        if tuple(sorted(set(self.layers))) != tuple(self.layers):
            raise ValueError(f"MoEConfig.layers must be sorted and unique, got {self.layers}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("MoEConfig.shared_expert_gate needs shared experts "
                             "(shared_intermediate_size > 0)")

    def replace(self, **kw) -> "MoEConfig":
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static configuration of a Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, ERNIE-4.5 dense).

    Attributes:
      architecture: HF architecture name, e.g. ``"LlamaForCausalLM"`` (informational).
      vocab_size: rows of the embedding table V.
      hidden_size: H.
      intermediate_size: I, SwiGLU inner width.
      num_layers: L, number of decoder layers.
      num_heads: query heads Nq.
      num_kv_heads: key/value heads Nkv (GQA when Nkv < Nq); Nq % Nkv == 0.
      head_dim: D (for MLA: the rotary part ``qk_rope_head_dim``, as transformers'
        ``DeepseekV3Config.head_dim``).
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: optional llama3 scaling.
      tie_word_embeddings: LM head is the embedding table transposed.
      attention_bias: q/k/v projections have biases (Qwen2).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      max_position_embeddings: informational upper bound on positions.
      bos_token_id / eos_token_ids: special ids (eos_token_ids may hold several ids).
      num_mtp_layers: number of MTP modules in the checkpoint (0: none; a fresh head is made).
      mtp_layout: how the MTP modules are wired (:func:`jmtp.model.llama.mtp_forward`):

        * ``"deepseek"``: own final norm ``shared_head.norm``, the pre-norm hidden fed back;
        * ``"ernie"``: the target's final norm shared, the post-norm hidden fed back;
        * ``"mimo"`` (MiMo-7B, ``model.mtp_layers.{j}``): own ``final_layernorm``, the post-norm
          hidden fed back, the embedding zeroed at MTP position 0, and the head takes the
          target's *pre*-final-norm hidden (:attr:`mtp_takes_prenorm_hidden`);
        * ``"qwen3_next"`` (Qwen3-Next / Qwen3.5 ``mtp.*``, vLLM ``qwen3_next_mtp``): own final norm
          ``mtp.norm``, the post-norm hidden fed back, the target's post-norm hidden taken.
      draft_vocab_size: FR-Spec draft vocabulary the checkpoint's MTP head was trained for (Zhao et
        al. 2025, arXiv 2502.14856; EAGLE-3's ``draft_vocab_size``): its drafts score only the N most
        frequent tokens, ranked in ``params["draft_vocab"] i32[V]``. 0 = the full vocabulary.
        The default of :class:`~jmtp.runtime.config.SpeculativeConfig` ``draft_vocab_size``.
      attention_type: ``"gqa"`` (standard multi-/grouped-query attention, the default) or
        ``"mla"`` (DeepSeek-V2/V3 multi-head latent attention, :mod:`jmtp.model.mla`; the fields
        below then describe it and ``head_dim`` must equal ``qk_rope_head_dim``).
      q_lora_rank: MLA query compression rank (``q_a_proj``/``q_b_proj``), None = one ``q_proj``.
      kv_lora_rank: MLA compressed KV latent width C (the cache holds C + qk_rope_head_dim per
        token).
      qk_nope_head_dim / qk_rope_head_dim: MLA per-head query/key widths without / with RoPE.
      v_head_dim: MLA per-head value width.
      mla_path: which MLA attention the forward runs: ``"absorbed"`` (W_UK folded into the
        query, W_UV applied after attention: MQA over the latent cache, the decode path) or
        ``"expanded"`` (the cached latents up-projected to per-head keys/values, the prefill
        path). Both compute the same function (tests check them equal).
      partial_rotary_factor: RoPE rotates the first ``int(D · factor)`` dims of each head only
        (GLM-4.5: 0.5, rotate-half layout within them); 1 = all of them.
      moe: the mixture-of-experts FFN of the layers it lists (:class:`MoEConfig`); None = dense.
      layer_types: per target layer ``"full_attention"`` or ``"linear_attention"`` (HF
        ``layer_types``; Qwen3-Next / Qwen3.5: three gated-DeltaNet layers then one full
        attention layer); empty = every layer full attention. Only full-attention layers have a
        paged KV cache (:attr:`kv_layers`); linear-attention layers keep a recurrent state per
        slot (:mod:`jmtp.model.gated_deltanet`). The MTP modules are full attention.
      linear: the gated-DeltaNet dimensions (:class:`LinearAttentionConfig`); required when a
        layer is ``"linear_attention"``.
      attn_output_gate: the attention output is gated per channel by ``sigmoid(x @ wg)`` before
        ``wo`` (Qwen3-Next / Qwen3.5 gated attention: HF ``q_proj`` doubled, each head's query
        followed by its gate); ``wg f[H, Nq·D]``.
      quantization: which weights are 8-bit and how (:class:`jmtp.model.quant.QuantConfig`:
        an FP8 checkpoint's block-scaled weights, or ``LLM(quantization="int8" | "fp8")``);
        None: every weight in the model dtype.
      batch_invariant: an engine's numerics choice, not the checkpoint's (set by
        ``LLM(batch_invariant=True)``): every matmul runs over fixed tiles of rows and attention
        over fixed query tiles and key chunks (:mod:`jmtp.model.invariant`), so each row's
        result does not depend on the other rows of the batch. Dense attention models only.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_mtp_layers: int = 1
    mtp_layout: Literal["deepseek", "ernie", "mimo", "qwen3_next"] = "deepseek"
    draft_vocab_size: int = 0
    attention_type: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_path: Literal["absorbed", "expanded"] = "absorbed"
    partial_rotary_factor: float = 1.0
    moe: MoEConfig | None = None
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    quantization: QuantConfig | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got "
                             f"{self.head_dim}")
        bad = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"ModelConfig.eos_token_ids {bad} outside [0, vocab_size="
                             f"{self.vocab_size})")
        check_one_of("ModelConfig.mtp_layout", self.mtp_layout, MTP_LAYOUTS)
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"ModelConfig.draft_vocab_size must lie in [0, vocab_size="
                             f"{self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"ModelConfig.num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
        rd = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rd < 2 or rd % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor ({self.partial_rotary_factor}) "
                             f"must lie in (0, 1] and give an even rotary dim >= 2 of head_dim "
                             f"{self.head_dim}, got {rd}")
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.layers):
            raise ValueError(f"ModelConfig.moe.layers {self.moe.layers} must lie in [0, "
                             f"num_layers={self.num_layers})")
        check_one_of("ModelConfig.attention_type", self.attention_type, ATTENTION_TYPES)
        if self.attention_type == "mla":
            self._check_mla()
        if self.layer_types:
            self._check_hybrid()

    def _check_hybrid(self):
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, "
                             f"expected num_layers={self.num_layers}")
        for i, t in enumerate(self.layer_types):
            check_one_of(f"ModelConfig.layer_types[{i}]", t, LAYER_TYPES)
        if self.linear is None and "linear_attention" in self.layer_types:
            raise ValueError("ModelConfig.linear (LinearAttentionConfig) is required when a "
                             "layer is 'linear_attention'")
        if not self.kv_layers:
            raise ValueError("ModelConfig.layer_types: at least one layer must be "
                             "'full_attention' (the paged KV cache and the MTP layer need one)")
        if self.is_mla and self.is_hybrid:
            raise ValueError("ModelConfig: linear-attention layers with attention_type='mla' "
                             "are not supported")

    def _check_mla(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1 for attention_type='mla', got "
                                 f"{getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"ModelConfig.q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"ModelConfig.head_dim ({self.head_dim}) must equal qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}) for attention_type='mla' (RoPE width)")
        if self.attention_bias or self.qk_norm:
            raise ValueError("ModelConfig.attention_bias / qk_norm are not supported with "
                             "attention_type='mla'")
        check_one_of("ModelConfig.mla_path", self.mla_path, MLA_PATHS)

    @property
    def mtp_takes_prenorm_hidden(self) -> bool:
        """Whether the MTP head takes the target's last hidden state *before* its final norm
        (MiMo: vLLM ``models/mimo.py`` returns ``hidden_states + residual`` un-normed and applies
        ``model.norm`` in ``compute_logits`` only) instead of the post-norm one (DeepSeek, ERNIE)."""
        return self.mtp_layout == "mimo"

    @property
    def mtp_feeds_back_prenorm(self) -> bool:
        """Whether a chained MTP substep gets the previous substep's hidden before the module's
        final norm (DeepSeek) or after it (ERNIE, MiMo)."""
        return self.mtp_layout == "deepseek"

    @property
    def is_mla(self) -> bool:
        return self.attention_type == "mla"

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_heads(self) -> int:
        """Heads of the paged cache: ``num_kv_heads``, or 1 for MLA (one shared latent)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """Width of one cache head: ``head_dim``, or ``kv_lora_rank + qk_rope_head_dim`` for MLA."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates: ``int(head_dim · partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Whether target layer ``i``'s FFN is the MoE block."""
        return self.moe is not None and i in self.moe.layers

    @property
    def moe_layer_kinds(self) -> tuple[bool, ...]:
        """``is_moe_layer(i)`` for every target layer."""
        return tuple(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the MTP modules' FFN is the MoE block."""
        return self.moe is not None and self.moe.mtp_moe

    def layer_type(self, i: int) -> str:
        """``"full_attention"`` or ``"linear_attention"`` of target layer ``i``."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def is_hybrid(self) -> bool:
        """Whether some target layer is a linear-attention (gated DeltaNet) layer."""
        return "linear_attention" in self.layer_types

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers: the layers of the paged KV cache, in order
        (cache layer ``j`` belongs to target layer ``kv_layers[j]``)."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_type(i) == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention layers (state layer ``j`` is target layer
        ``linear_layers[j]``)."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_type(i) == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        """Layers of the target's paged KV cache (``num_layers`` unless hybrid)."""
        return len(self.kv_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
