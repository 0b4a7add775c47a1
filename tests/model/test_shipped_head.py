"""The MTP head jmtp ships for SmolLM2-135M-Instruct: loaded by default, small, self-describing."""
from __future__ import annotations

import os

import numpy as np
import pytest

from jmtp.model.checkpoints.loader import SHIPPED_HEADS, shipped_head_path
from jmtp.model.checkpoints.mtp_head import head_metadata, load_draft_ranking, load_mtp_head


def test_shipped_head_file_is_small_and_complete(smollm2_gguf):
    path = shipped_head_path(smollm2_gguf)
    assert path is not None and path.name == SHIPPED_HEADS[os.path.basename(smollm2_gguf)]
    assert path.stat().st_size < 20 * 2 ** 20
    meta = head_metadata(str(path))
    assert meta["format"] == "jmtp-mtp-head-v1"
    assert meta["hidden_size"] == "576" and meta["vocab_size"] == "49152"
    assert int(meta["steps"]) > 0 and meta["labels"] == "target"
    ranking = load_draft_ranking(str(path))
    assert sorted(ranking.tolist()) == list(range(49152))          # a permutation of the vocab
    assert 0 < int(meta["draft_vocab_size"]) < 49152


def test_default_model_loads_the_shipped_head(smollm2, smollm2_gguf):
    cfg, params = smollm2
    path = str(shipped_head_path(smollm2_gguf))
    assert cfg.draft_vocab_size == int(head_metadata(path)["draft_vocab_size"])
    assert params["draft_vocab"].tolist() == load_draft_ranking(path).tolist()
    head = load_mtp_head(path)
    np.testing.assert_array_equal(np.asarray(params["mtp"]["eh_proj"]),
                                  np.asarray(head["eh_proj"], np.float32))


def test_mtp_head_none_gives_a_fresh_head(smollm2, smollm2_gguf):
    import jax.numpy as jnp

    from jmtp.model import load_checkpoint

    cfg, params = load_checkpoint(smollm2_gguf, dtype=jnp.float32, mtp_head=None)
    assert cfg.draft_vocab_size == 0 and "draft_vocab" not in params
    shipped = smollm2[1]["mtp"]["eh_proj"]
    assert not np.array_equal(np.asarray(params["mtp"]["eh_proj"]), np.asarray(shipped))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(smollm2_gguf, dtype=jnp.float32, mtp_head="/nonexistent/head.safetensors")


def test_shipped_head_loads_as_an_nnx_module(smollm2, smollm2_gguf):
    """The shipped file fills an MTPHead module (load_mtp_head_module) with the arrays the default
    model's dict carries, every parameter with its logical axes."""
    import jax.numpy as jnp
    from flax import nnx

    from jmtp.model import MTPHead, load_mtp_head_module
    from jmtp.model import axes as ax

    cfg, params = smollm2
    head = load_mtp_head_module(str(shipped_head_path(smollm2_gguf)), cfg, dtype=jnp.float32)
    assert isinstance(head, MTPHead) and head.eh_proj.shape == (1, 2 * 576, 576)
    got, want = head.to_params(), params["mtp"]
    assert sorted(got) == sorted(want) and sorted(got["layer"]) == sorted(want["layer"])
    for name in ("enorm", "hnorm", "eh_proj", "final_norm"):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    for name in want["layer"]:
        np.testing.assert_array_equal(np.asarray(got["layer"][name]), np.asarray(want["layer"][name]))
    for path, var in nnx.to_flat_state(nnx.state(head, nnx.Param)):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.ndim and names[0] == ax.LAYERS, (path, names)
