"""The converted-weights cache (:mod:`jmtp.model.checkpoints.weights_cache`): a second load of a GGUF file
reads the cache instead of converting, and gives exactly the first load's config, parameters and
tokenizer; the key follows the file's bytes, the dtype and the conversion code; a broken or
unwritable cache never breaks loading."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmtp.model.checkpoints import weights_cache as wc
from jmtp.model.config import ModelConfig, MoEConfig, RopeScaling
from jmtp.model.checkpoints.gguf_loader import load_gguf
from jmtp.model.checkpoints.loader import load_checkpoint, load_tokenizer
from jmtp.model.checkpoints.tokenizer import tokenizer_from_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_moe"
# MoE with tuple fields (qwen3moe); MLA with YaRN rope scaling (deepseek2)
FILES = [FIXTURES / "qwen3moe" / "model.gguf", FIXTURES / "deepseek2" / "model.gguf"]


def _counting(path, dtype):
    calls = []

    def convert():
        calls.append(1)
        return load_gguf(path, dtype)
    return convert, calls


def _assert_same(a, b):
    (ca, pa), (cb, pb) = a, b
    assert ca == cb
    la, ta = jax.tree_util.tree_flatten(pa)
    lb, tb = jax.tree_util.tree_flatten(pb)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.parent.name)
def test_second_load_reads_the_cache_and_equals_the_conversion(tmp_path, path):
    convert, calls = _counting(path, jnp.float32)
    first = wc.load_params_cached(path, jnp.float32, convert, cache_dir=str(tmp_path))
    second = wc.load_params_cached(path, jnp.float32, convert, cache_dir=str(tmp_path))
    assert len(calls) == 1
    _assert_same(first, second)
    _assert_same(first, load_gguf(path, jnp.float32))
    entries = [p.name for p in tmp_path.iterdir()]
    assert entries == [f"{wc.file_digest(path)}-float32-{wc.code_digest()}"]


def test_key_follows_bytes_and_dtype_not_the_name(tmp_path):
    src = FILES[0]
    cache = str(tmp_path / "cache")
    convert, calls = _counting(src, jnp.float32)
    wc.load_params_cached(src, jnp.float32, convert, cache_dir=cache)
    copy = tmp_path / "renamed.gguf"
    shutil.copy(src, copy)                      # same bytes, other name: a hit
    wc.load_params_cached(copy, jnp.float32, convert, cache_dir=cache)
    assert len(calls) == 1
    bf16, bcalls = _counting(src, jnp.bfloat16)  # other dtype: its own entry, dtype kept
    _, params = wc.load_params_cached(src, jnp.bfloat16, bf16, cache_dir=cache)
    _, again = wc.load_params_cached(src, jnp.bfloat16, bf16, cache_dir=cache)
    assert len(bcalls) == 1 and again["embed"].dtype == jnp.bfloat16
    changed = tmp_path / "changed.gguf"         # one byte of tensor data differs: a miss
    data = bytearray(src.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    c2, calls2 = _counting(changed, jnp.float32)
    wc.load_params_cached(changed, jnp.float32, c2, cache_dir=cache)
    assert len(calls2) == 1


def test_a_broken_entry_is_converted_again(tmp_path, caplog):
    path = FILES[0]
    convert, calls = _counting(path, jnp.float32)
    wc.load_params_cached(path, jnp.float32, convert, cache_dir=str(tmp_path))
    (entry,) = tmp_path.iterdir()
    (entry / "params.safetensors").write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="jmtp.model.checkpoints.weights_cache"):
        got = wc.load_params_cached(path, jnp.float32, convert, cache_dir=str(tmp_path))
    assert len(calls) == 2 and "unreadable" in caplog.text
    _assert_same(got, load_gguf(path, jnp.float32))


def test_an_unwritable_cache_only_warns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    convert, calls = _counting(FILES[0], jnp.float32)
    with caplog.at_level(logging.WARNING, logger="jmtp.model.checkpoints.weights_cache"):
        got = wc.load_params_cached(FILES[0], jnp.float32, convert, cache_dir=str(blocker / "c"))
    assert len(calls) == 1 and "could not write" in caplog.text
    _assert_same(got, load_gguf(FILES[0], jnp.float32))


def test_env_folder_and_off(monkeypatch, tmp_path):
    monkeypatch.setenv("JMTP_WEIGHTS_CACHE_DIR", str(tmp_path / "w"))
    assert wc.default_weights_cache_dir() == str(tmp_path / "w")
    for off in ("off", "0", "none", ""):
        monkeypatch.setenv("JMTP_WEIGHTS_CACHE_DIR", off)
        assert wc.default_weights_cache_dir() is None
    monkeypatch.delenv("JMTP_WEIGHTS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wc.default_weights_cache_dir() == str(tmp_path / "xdg" / "jmtp" / "weights")


def test_config_round_trip_with_nested_configs():
    cfg = ModelConfig(
        architecture="X", vocab_size=300, eos_token_ids=(1, 2),
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=512),
        moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      layers=(1,)))
    back = wc.config_from_dict(wc.config_to_dict(cfg))
    assert back == cfg and isinstance(back.eos_token_ids, tuple)
    assert isinstance(back.moe.layers, tuple)


def test_load_checkpoint_uses_the_cache(monkeypatch, tmp_path):
    """load_checkpoint converts a GGUF file once; the second load reads the entry."""
    import jmtp.model.checkpoints.gguf_loader as gl
    calls = []
    real = gl.load_gguf
    monkeypatch.setattr(gl, "load_gguf", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("JMTP_WEIGHTS_CACHE_DIR", str(tmp_path))
    first = load_checkpoint(FILES[0], dtype=jnp.float32, mtp_head=None)
    second = load_checkpoint(FILES[0], dtype=jnp.float32, mtp_head=None)
    assert len(calls) == 1
    _assert_same(first, second)


def test_entries_of_other_conversion_code_are_replaced(tmp_path):
    """An entry of the same file and dtype written by other code (another digest) is never read
    and is removed when the current one is published; other files' entries stay."""
    path = FILES[0]
    stale = tmp_path / f"{wc.file_digest(path)}-float32-0123456789abcdef"
    other = tmp_path / f"{'0' * 64}-float32-0123456789abcdef"
    for d in (stale, other):
        d.mkdir()
        (d / "config.json").write_text("{}")
    convert, calls = _counting(path, jnp.float32)
    wc.load_params_cached(path, jnp.float32, convert, cache_dir=str(tmp_path))
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other.name, f"{wc.file_digest(path)}-float32-{wc.code_digest()}"])


@pytest.mark.slow
def test_smollm2_tokenizer_from_the_cache(monkeypatch, tmp_path, smollm2_gguf):
    """The cached tokenizer (tokenizers JSON + meta) encodes, decodes and renders the chat template
    as the one built from the GGUF metadata."""
    monkeypatch.setenv("JMTP_WEIGHTS_CACHE_DIR", str(tmp_path))
    built = tokenizer_from_gguf(smollm2_gguf)
    load_tokenizer(smollm2_gguf)                           # builds and stores
    cached = load_tokenizer(smollm2_gguf)                  # reads the entry
    assert any(p.name.split("-")[1] == "tokenizer" for p in tmp_path.iterdir())
    texts = ["Hello, world!", "  ünïcödé 12345\n\tx", "<|im_start|>user\nhi<|im_end|>", ""]
    for t in texts:
        assert cached.encode(t) == built.encode(t)
        assert cached.encode(t, add_special_tokens=True) == built.encode(t, add_special_tokens=True)
        ids = built.encode(t)
        assert cached.decode(ids) == built.decode(ids)
        assert cached.decode(ids, skip_special_tokens=False) == built.decode(
            ids, skip_special_tokens=False)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.apply_chat_template(msgs) == built.apply_chat_template(msgs)
    assert (cached.eos_token_ids, cached.bos_token_id, cached.vocab_size) == (
        built.eos_token_ids, built.bos_token_id, built.vocab_size)
