"""The MTP head's optimiser, train model and jitted train step.

The head is an :class:`~jmtp.model.modules.MTPHead` (Flax NNX) optimised by an
``nnx.Optimizer(head, tx, wrt=nnx.Param)`` with the optax chain of :func:`make_optimizer`; both
sit in an :class:`MTPTrainModel`, split once (``nnx.split``) into a static graph definition and
the pure ``nnx.State`` that :func:`train_step` takes and returns (merged inside ``jax.jit``, as
the engine's step does). The loss (:func:`jmtp.train.objective.loss_fn`) runs the pure functions
on ``head.to_params()``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.modules import MTPHead
from jmtp.train.config import TrainConfig
from jmtp.train.objective import loss_fn


def decay_mask(tree):
    """AdamW weight-decay mask of :func:`make_optimizer`: True for the matrices (``eh_proj``,
    ``layer.wq/wk/wv/wo/w_gate/w_up/w_down``: ``ndim >= 3`` with the leading ``layers`` axis),
    False for norms and biases.

    ``tree`` is the head's parameters as optax sees them: a dict, or the ``nnx.State`` of an
    :class:`MTPHead` (``nnx.Param`` leaves at ``init``, arrays at ``update``; ``tree_map`` reaches
    the array inside each Param, so the mask has the tree's own structure)."""
    return jax.tree_util.tree_map(lambda a: a.ndim >= 3, tree)


@functools.lru_cache(maxsize=None)
def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW (decay on matrices only, :func:`decay_mask`) with linear
    warm-up and cosine decay.

    One object per ``tcfg`` (cached): the transformation is static data of the optimizer's graph
    definition, so trainers with equal configs share :func:`train_step`'s compiled programs."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.lr * tcfg.min_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(tcfg.grad_clip),
        optax.adamw(sched, b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay, mask=decay_mask))


def learning_rate(tcfg: TrainConfig, step):
    """The schedule of :func:`make_optimizer` at ``step`` (0-based)."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.lr * tcfg.min_lr_ratio)(step)


class TrainRng(nnx.Variable):
    """The training run's random key data (``u32[2]``, feature noise); not an ``nnx.Param``, so
    the optimizer leaves it alone."""


class MTPTrainModel(nnx.Module):
    """Everything one training run updates, as one NNX graph.

    Attributes:
      mtp: the :class:`MTPHead` being trained (fp32 Params with their logical axes).
      opt: ``nnx.Optimizer(mtp, tx, wrt=nnx.Param)``: ``opt.step u32[]`` (optimiser steps taken)
        and ``opt.opt_state`` (optax's state of ``tx``, moments shaped like the head's Params).
      rng: :class:`TrainRng` key data ``u32[2]`` of the feature-noise stream.

    ``nnx.split`` gives the graph definition (static: also holds ``tx``) and the pure state with
    entries ``"mtp"``, ``"opt"``, ``"rng"`` that :func:`train_step` takes and returns.
    """

    def __init__(self, head: MTPHead, tx: optax.GradientTransformation, seed: int):
        self.mtp = head
        self.opt = nnx.Optimizer(head, tx, wrt=nnx.Param)
        self.rng = TrainRng(jax.random.key_data(jax.random.key(seed)))


def state_step(state: nnx.State) -> int:
    """Optimiser steps taken by the train state ``state`` (its ``opt.step``)."""
    return int(state["opt"]["step"][...])


@functools.partial(jax.jit, static_argnums=0, static_argnames=("cfg", "tcfg"))
def train_step(graphdef: nnx.GraphDef, state: nnx.State, batch, frozen, head_w, label_map, *,
               cfg: ModelConfig, tcfg: TrainConfig):
    """One optimiser step on the pure train state (``graphdef, state = nnx.split(model)`` of an
    :class:`MTPTrainModel`); returns ``(new state, metrics)``.

    Inside the jitted function the state is merged with ``graphdef``, the loss (:func:`loss_fn` on
    ``head.to_params()``) differentiated with respect to the head's Params, and
    ``opt.update(head, grads)`` applies :func:`make_optimizer`'s chain; ``opt.step`` and ``rng``
    advance. ``metrics``: the loss terms of :func:`loss_fn` plus ``grad_norm`` (before clipping)
    and ``lr`` (the schedule at this step), f32 scalars.

    Compiled once per ``(graphdef, cfg, tcfg)`` and shapes (shared by every trainer instance with
    an equal config: :func:`make_optimizer` is cached).
    """
    model = nnx.merge(graphdef, state)
    key = jax.random.wrap_key_data(model.rng[...])
    key, sub = jax.random.split(key)
    noise_key = sub if tcfg.feature_noise > 0 else None

    def objective(head: MTPHead):
        return loss_fn(head.to_params(), frozen, head_w, label_map, batch, noise_key,
                       cfg=cfg, tcfg=tcfg)

    (_, metrics), grads = nnx.value_and_grad(objective, has_aux=True)(model.mtp)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = learning_rate(tcfg, model.opt.step[...].astype(jnp.int32))
    model.opt.update(model.mtp, grads)
    model.rng[...] = jax.random.key_data(key)
    return nnx.state(model), metrics
