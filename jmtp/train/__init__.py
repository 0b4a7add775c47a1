"""MTP head training by self-distillation (frozen target, cached hidden states).

* :mod:`jmtp.train.data` — prompts, target generations, cached hidden states, packed batches;
* :mod:`jmtp.train.corpus` — teacher-forced text (Python docs and stdlib, PSF) as chat turns;
* :mod:`jmtp.train.dense` — the MTP module over packed rows (training forward, recursive passes);
* :mod:`jmtp.train.mtp_trainer` — objective, the NNX head + ``nnx.Optimizer`` (optax) training
  loop, orbax checkpoints, evaluation, export.

CLI: ``scripts/train_mtp.py``.
"""
from jmtp.model.mtp_head import load_mtp_head_module
from jmtp.train.data import (MTPData, Prompt, build_dataset, encode_chat, engine_generate,
                             generate_tokens, load_prompts, make_batch, pack_rows, split_prompts,
                             target_top1, token_frequencies)
from jmtp.train.dense import dense_mtp_forward
from jmtp.train.mtp_trainer import (MTPTrainer, MTPTrainModel, TrainConfig, export_mtp_head,
                                    head_metadata, load_draft_vocab, load_mtp_head, make_optimizer,
                                    state_step, train_step)

__all__ = [
    "MTPData", "Prompt", "build_dataset", "encode_chat", "engine_generate", "generate_tokens",
    "load_prompts", "make_batch", "pack_rows", "split_prompts", "target_top1",
    "token_frequencies",
    "dense_mtp_forward",
    "MTPTrainer", "MTPTrainModel", "TrainConfig", "export_mtp_head", "head_metadata",
    "load_draft_vocab", "load_mtp_head", "load_mtp_head_module", "make_optimizer", "state_step",
    "train_step",
]
