"""MTP head training by self-distillation (frozen target, cached hidden states).

Data pipeline (each step is a function over token ids, so any tokenizer / generator can be plugged
in):

* :mod:`jmtp.train.prompts` — prompts from licensed offline sources, the train/eval split by
  prompt, chat templating;
* :mod:`jmtp.train.generation` — the frozen target's responses (batched paged generator, or the
  engine), optionally with its hidden states captured on the way;
* :mod:`jmtp.train.selfgen` — generation at scale: one serving engine answers planned jobs into
  the content-addressed :mod:`jmtp.train.token_cache` (resumable, sessions add to it);
* :mod:`jmtp.train.capture` — the target's hidden states of many sequences in batched dense
  forwards (any device), optionally several layers' (EAGLE-3's features);
* :mod:`jmtp.train.corpus` — teacher-forced text (Python docs and stdlib, PSF) as chat turns;
* :mod:`jmtp.train.data` — cached target hidden states (:class:`MTPData`), packed ``[B, W]`` batches.

Training:

* :mod:`jmtp.train.dense` — the MTP module over packed rows (training forward, recursive passes);
* :mod:`jmtp.train.config` — :class:`TrainConfig`, the hyper-parameters of one run;
* :mod:`jmtp.train.objective` — loss (CE, KL, recursive passes) and acceptance statistics;
* :mod:`jmtp.train.step` — the NNX head + ``nnx.Optimizer`` (optax) train model and jitted step;
* :mod:`jmtp.train.mtp_trainer` — the training loop, orbax checkpoints, evaluation, export.

CLI: ``scripts/train_mtp.py``.
"""
from jmtp.model.checkpoints.mtp_head import load_mtp_head_module
from jmtp.train.config import TrainConfig
from jmtp.train.data import MTPData, build_dataset, make_batch, pack_rows, target_top1, token_frequencies
from jmtp.train.dense import dense_mtp_forward
from jmtp.train.generation import engine_generate, generate_tokens
from jmtp.train.mtp_trainer import (MTPTrainer, export_mtp_head, head_metadata, load_draft_vocab,
                                    load_mtp_head)
from jmtp.train.prompts import Prompt, encode_chat, load_prompts, split_prompts
from jmtp.train.step import MTPTrainModel, make_optimizer, state_step, train_step

__all__ = [
    "MTPData", "Prompt", "build_dataset", "encode_chat", "engine_generate", "generate_tokens",
    "load_prompts", "make_batch", "pack_rows", "split_prompts", "target_top1",
    "token_frequencies",
    "dense_mtp_forward",
    "MTPTrainer", "MTPTrainModel", "TrainConfig", "export_mtp_head", "head_metadata",
    "load_draft_vocab", "load_mtp_head", "load_mtp_head_module", "make_optimizer", "state_step",
    "train_step",
]
