"""Hyper-parameters of one MTP-head training run (:class:`TrainConfig`).

Read by the objective (:mod:`jmtp.train.objective`), the optimiser and train step
(:mod:`jmtp.train.step`) and the trainer (:mod:`jmtp.train.mtp_trainer`, which saves it as
``config.json`` beside the weights and refuses to resume a run whose trajectory fields changed).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (saved as ``config.json`` beside the weights).

    Attributes:
      steps: optimiser steps in total (the schedule's length).
      batch_size: packed rows per step B.
      seq_len: MTP rows per packed row W (longer sequences are cut into chunks of W).
      lr: peak learning rate; warm-up from 0 over ``warmup_steps``, cosine to ``lr * min_lr_ratio``.
      warmup_steps: linear warm-up steps (must be < steps).
      min_lr_ratio: final learning rate / peak.
      weight_decay: AdamW decoupled weight decay (Loshchilov & Hutter 2019), matrices only.
      b1, b2: Adam moments.
      grad_clip: global-norm gradient clipping threshold.
      seed: seeds data order and the feature-noise rng.
      num_passes: recursive passes trained (1 = plain MTP objective).
      recursive_weight: loss weight of passes >= 2.
      kl_weight: weight of KL(target || mtp) added to the cross-entropy (0 = off).
      feature_noise: std of Gaussian noise added to the target hidden state (EAGLE-style robustness;
        0 = off).
      draft_vocab_size: 0 = full vocabulary; N = FR-Spec top-N training vocabulary.
      labels: ``"data"`` (the generated token x_{p+2}) or ``"target"`` (the target's own greedy
        prediction of x_{p+2}, ``MTPData.top1``; what greedy verification accepts).
      prompt_rows: also train on rows inside the prompt (with ``labels="target"``).
      eval_every: steps between evaluations; eval_passes: drafts evaluated (K up to this).
      ckpt_every: steps between orbax checkpoints; keep_checkpoints: how many to keep.
      layer_idx: which MTP module to train.
      progress: show a tqdm bar.
    """

    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    num_passes: int = 1
    recursive_weight: float = 0.5
    kl_weight: float = 0.0
    feature_noise: float = 0.0
    draft_vocab_size: int = 0
    labels: str = "data"
    prompt_rows: bool = False
    eval_every: int = 50
    eval_passes: int = 3
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    layer_idx: int = 0
    progress: bool = True

    def __post_init__(self):
        pos = ("steps", "batch_size", "num_passes", "eval_every", "eval_passes", "ckpt_every",
               "keep_checkpoints")
        for name in pos:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"TrainConfig.seq_len must be >= 2, got {self.seq_len}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"TrainConfig.warmup_steps must lie in [0, steps={self.steps}), got {self.warmup_steps}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        for name in ("min_lr_ratio", "weight_decay", "recursive_weight", "kl_weight", "feature_noise",
                     "draft_vocab_size", "layer_idx"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.labels not in ("data", "target"):
            raise ValueError(f"TrainConfig.labels must be 'data' or 'target', got {self.labels!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0, got {self.grad_clip}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
