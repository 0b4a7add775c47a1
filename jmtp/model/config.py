"""Model configuration: the static description of a Llama-family decoder and its MTP head.

A :class:`ModelConfig` is frozen and hashable, so it can be passed to ``jax.jit`` as a static
argument. Every shape of the parameter pytree (see :mod:`jmtp.model.params`) follows from it.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

MTP_LAYOUTS = ("deepseek", "ernie")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"`` in HF configs).

    Attributes:
      factor: wavelength stretch for low frequencies.
      low_freq_factor / high_freq_factor: band edges, as in HF ``_compute_llama3_parameters``.
      original_max_position_embeddings: context length the base model was trained for.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
      head_dim: D.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: optional llama3 scaling.
      tie_word_embeddings: LM head is the embedding table transposed.
      attention_bias: q/k/v projections have biases (Qwen2).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      max_position_embeddings: informational upper bound on positions.
      bos_token_id / eos_token_ids: special ids (eos_token_ids may hold several ids).
      num_mtp_layers: number of MTP modules in the checkpoint (0: none; a fresh head is made).
      mtp_layout: "deepseek" (own final norm ``shared_head.norm``, pre-norm hidden fed back) or
        "ernie" (target final norm shared, post-norm hidden fed back).
      draft_vocab_size: FR-Spec draft vocabulary the checkpoint's MTP head was trained for (Zhao et
        al. 2025, arXiv 2502.14856; EAGLE-3's ``draft_vocab_size``): its drafts score only the N most
        frequent tokens, ranked in ``params["draft_vocab"] i32[V]``. 0 = the full vocabulary.
        The default of :class:`~jmtp.runtime.config.SpeculativeConfig` ``draft_vocab_size``.
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
    mtp_layout: Literal["deepseek", "ernie"] = "deepseek"
    draft_vocab_size: int = 0

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
        if self.mtp_layout not in MTP_LAYOUTS:
            raise ValueError(f"ModelConfig.mtp_layout must be one of {MTP_LAYOUTS}, got {self.mtp_layout!r}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"ModelConfig.draft_vocab_size must lie in [0, vocab_size="
                             f"{self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"ModelConfig.num_mtp_layers must be >= 0, got {self.num_mtp_layers}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
