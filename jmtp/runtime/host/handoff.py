"""Prefill → decode hand-off: a request's state as a transferable object (disaggregated serving).

An engine that ran a request's prefill exports it as a :class:`RequestState`: the request's row of
:class:`~jmtp.runtime.device.state.EngineState` (tokens so far, ``seq_lens_*``, ``step_idx``, the first
verify window ``draft_tokens`` and, with ``draft_sampling``, the drafts' distributions
``draft_probs``, the sampling row with its seed and ``rng_offset``), the KV pages its block table
points to in both caches (target and MTP, gathered to host in sequence order), and the host-side
request (prompt, :class:`~jmtp.runtime.host.sampling_params.SamplingParams` with the seed fixed, tokens,
logprobs and speculation counters so far). Another engine imports it into an idle slot: it pops
blocks from its own device free stack, scatters the pages into them and writes the row
(:func:`jmtp.runtime.device.handoff_ops.import_slot`, one jitted call), and its next step
verifies the imported window at once.

The MTP head needs no "last hidden state" of its own: in jmtp's shadow-state design (the MTP's
decode state is the target's minus ``accept_num``, as later FastDeploy versions do; nothing is
rolled back) MTP cache position ``p`` holds ``(x_{p+1}, h_p)`` for every position the target has
cached, and the next step feeds the MTP the target's hidden rows of the window it verifies, so the
MTP KV pages are the whole proposer state. The random stream continues because every draw is keyed
by (seed, output position, purpose) (:mod:`jmtp.runtime.device.sampling.rng`) and the row carries the
seed, ``rng_offset`` and ``step_idx``. Hence any K and M: the window holds the K drafts of the
last MTP proposal, whatever K is (FastDeploy's "splitwise" hands MTP state over for K = 1 only).
A hybrid (gated-DeltaNet) target's linear layers have no KV pages: the request carries its slot's
recurrent and convolution state at the slot's current checkpoint instead
(:func:`jmtp.model.state_checkpoints.slot_state`, ``kv["linear_*"]``), written back into the same
checkpoint on import; the fingerprint covers its layout (:func:`linear_state_layout`).

The layout is versioned (:data:`HANDOFF_VERSION`) and :meth:`RequestState.to_bytes` /
:meth:`RequestState.from_bytes` serialise it to a numpy ``.npz`` archive (a JSON header plus raw
arrays, no pickle) so it can cross processes. An importer refuses (``ValueError``) a state of
another version or one whose :func:`engine_fingerprint` (model config, a digest of the weights,
speculative config, KV layout) differs from its own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.handoff_ops import LINEAR_PREFIX
from jmtp.runtime.host.outputs import SpecDecodeMetrics
from jmtp.runtime.host.sampling_params import SamplingParams

#: Layout version of :class:`RequestState` (bumped whenever a field or its meaning changes).
HANDOFF_VERSION = 4    # 4: the sampling row's seed_hi and logit_bias (64-bit seeds, OpenAI's
                       # logit_bias); 3: KV pages in the merged row layout
                       # (jmtp.pallas.kv_layout); 2: the window's draft budget
                       # (EngineState.actual_draft_token_num)

@dataclasses.dataclass
class RequestState:
    """One request handed from a prefill engine to a decode engine (host arrays only).

    Attributes:
      version: :data:`HANDOFF_VERSION` of the layout.
      fingerprint: hex SHA-256 of ``compat`` (the exporting engine's :func:`engine_fingerprint`).
      compat: what the fingerprint hashes (model config, weight digest, speculative config, KV
        layout), kept so a mismatch can be named.
      request_id: the exporting engine's request id (the importer keeps it).
      prompt: the prompt string, or None for a token-id prompt.
      prompt_token_ids: the prompt ids.
      sampling_params: the request's :class:`SamplingParams`, ``seed`` fixed to the seed its
        random stream runs on.
      bad_words_ids: ``sampling_params.bad_words`` as tokenized by the exporter.
      output_token_ids: tokens generated so far (the first token after a prefill).
      logprobs: per generated token ``{id: logprob}`` when requested, else None.
      metrics: speculation counters so far.
      finish_reason / stop_reason / text: set when the request finished on the exporter (then
        ``row`` and ``kv`` are empty and an import only returns its output).
      max_model_len: the exporter's ``max_model_len`` (an importer must stop the request at the
        same length).
      row: ``{field: array}`` the request's row of :class:`EngineState` (:data:`ROW_FIELDS`;
        ``input_ids`` cut to the tokens in the sequence, ``i32[prompt_len + step_idx]``; the
        sampling fields as ``"sampling.<name>"``).
      kv: the KV pages the request owns, in sequence order: ``target_k`` / ``target_v``
        ``[L, n, block_size, Nkv·D]``, ``mtp_k`` / ``mtp_v`` ``[M_layers, n, ...]`` (no MTP
        cache: absent), and ``*_k_scale`` / ``*_v_scale`` ``f32[L, n, Nkv, block_size]`` for a
        quantised cache. A hybrid (gated-DeltaNet) model's slot state too
        (:func:`jmtp.model.state_checkpoints.slot_state`): ``linear_conv f[Ll, Kc-1, conv_dim]``,
        ``linear_recurrent f32[Ll, Hv, Dk, Dv]`` (every linear layer's state after the last
        committed row) and ``linear_current i32[]`` (the checkpoint it sits in).
    """

    version: int
    fingerprint: str
    compat: dict
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    bad_words_ids: list[list[int]]
    output_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    metrics: SpecDecodeMetrics
    finish_reason: str | None
    stop_reason: int | str | None
    text: str
    max_model_len: int
    row: dict[str, np.ndarray]
    kv: dict[str, np.ndarray]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pages(self) -> int:
        """KV blocks the request owns (0 for a finished request)."""
        return int(self.kv["target_k"].shape[1]) if "target_k" in self.kv else 0

    def nbytes(self) -> dict[str, int]:
        """Array bytes: ``{"row": ..., "target_kv": ..., "mtp_kv": ..., "linear_state": ...,
        "total": ...}``."""
        row = sum(a.nbytes for a in self.row.values())
        part = lambda p: sum(a.nbytes for k, a in self.kv.items() if k.startswith(p))  # noqa: E731
        tgt, mtp, lin = part("target_"), part("mtp_"), part(LINEAR_PREFIX)
        return dict(row=row, target_kv=tgt, mtp_kv=mtp, linear_state=lin,
                    total=row + tgt + mtp + lin)

    # ------------------------------------------------------------------ bytes
    def to_bytes(self) -> bytes:
        """An uncompressed ``.npz`` archive: ``__meta__`` (UTF-8 JSON header: version,
        fingerprint, request, dtype and shape of each array) and one raw array per entry
        (``row/<field>``, ``kv/<name>``, stored as unsigned-int views so bf16 / fp8 survive
        ``numpy``). Read with :meth:`from_bytes`; no pickle either way."""
        arrays, dtypes = {}, {}
        for group, d in (("row", self.row), ("kv", self.kv)):
            for name, a in d.items():
                a = np.asarray(a)            # (not ascontiguousarray: it makes 0-d 1-d)
                key = f"{group}/{name}"
                dtypes[key] = [str(a.dtype), list(a.shape)]
                arrays[key] = np.ascontiguousarray(a.reshape(-1)).view(
                    np.dtype(f"u{a.dtype.itemsize}"))
        sp = dataclasses.asdict(self.sampling_params)
        meta = dict(
            version=self.version, fingerprint=self.fingerprint, compat=self.compat,
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids), sampling_params=sp,
            bad_words_ids=self.bad_words_ids, output_token_ids=list(self.output_token_ids),
            logprobs=(None if self.logprobs is None else
                      [[[int(t), float(v)] for t, v in d.items()] for d in self.logprobs]),
            metrics=dataclasses.asdict(self.metrics), finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, text=self.text, max_model_len=self.max_model_len,
            dtypes=dtypes)
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RequestState":
        """Inverse of :meth:`to_bytes`.

        Raises:
          ValueError: not a jmtp hand-off archive, or one of another :data:`HANDOFF_VERSION`.
        """
        try:
            npz = np.load(io.BytesIO(data), allow_pickle=False)
            meta = json.loads(bytes(npz["__meta__"]).decode())
        except Exception as e:   # noqa: BLE001 - any malformed input is a bad argument
            raise ValueError(f"RequestState.from_bytes: not a jmtp hand-off archive ({e})") from e
        if meta.get("version") != HANDOFF_VERSION:
            raise ValueError(f"RequestState.from_bytes: layout version {meta.get('version')!r}, "
                             f"this jmtp reads version {HANDOFF_VERSION}")
        row, kv = {}, {}
        for key, (dtype, shape) in meta["dtypes"].items():
            group, name = key.split("/", 1)
            a = npz[key].view(jnp.dtype(dtype)).reshape(shape)
            (row if group == "row" else kv)[name] = a
        sp = meta["sampling_params"]
        for f in ("stop_token_ids", "bad_token_ids", "bad_words"):
            sp[f] = tuple(sp[f])
        if isinstance(sp.get("stop"), list):
            sp["stop"] = tuple(sp["stop"])
        return cls(
            version=meta["version"], fingerprint=meta["fingerprint"], compat=meta["compat"],
            request_id=meta["request_id"], prompt=meta["prompt"],
            prompt_token_ids=list(meta["prompt_token_ids"]),
            sampling_params=SamplingParams(**sp), bad_words_ids=meta["bad_words_ids"],
            output_token_ids=list(meta["output_token_ids"]),
            logprobs=(None if meta["logprobs"] is None else
                      [{int(t): float(v) for t, v in d} for d in meta["logprobs"]]),
            metrics=SpecDecodeMetrics(**meta["metrics"]), finish_reason=meta["finish_reason"],
            stop_reason=meta["stop_reason"], text=meta["text"],
            max_model_len=meta["max_model_len"], row=row, kv=kv)


# ---------------------------------------------------------------------------- fingerprint
def _layer_index(path) -> int | None:
    """The layer number of a leaf of unstacked target layers (path ``layers, layers, i, ...``:
    ``LLM(layer_loop="unrolled")``), else None."""
    names = [getattr(k, "key", getattr(k, "idx", None)) for k in path[:3]]
    if len(names) == 3 and names[:2] == ["layers", "layers"] and isinstance(names[2], int):
        return names[2]
    return None


def params_digest(params) -> str:
    """CRC-32 (hex) over every parameter leaf's path, dtype, shape and a strided sample of at most
    ~4096 of its values: cheap (no full device-to-host copy) and different for any two checkpoints
    that differ in structure or in the sampled values.

    Independent of the layer loop: unstacked target layers (a leaf per layer,
    ``layer_loop="unrolled"``) are digested as the stacked ``f[L, ...]`` leaf they were split from
    (same path without the layer number, shape ``(L,) + shape``, the same strided sample), so a
    scan engine and an unrolled one with the same weights have the same digest."""
    groups: dict[str, list] = {}     # canonical path -> [(layer or None, array)]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = getattr(leaf, "value", leaf)
        layer = _layer_index(path)
        key = jax.tree_util.keystr(path if layer is None else path[:2] + path[3:])
        groups.setdefault(key, []).append((layer, x))
    crc = 0
    for key in sorted(groups):
        parts = sorted(groups[key], key=lambda lx: -1 if lx[0] is None else lx[0])
        x0 = parts[0][1]
        shape = tuple(x0.shape) if parts[0][0] is None else (len(parts),) + tuple(x0.shape)
        per = int(np.prod(x0.shape))
        stride = max(1, (per * len(parts)) // 4096)
        idx = np.arange(0, per * len(parts), stride)
        sample = np.concatenate([
            np.asarray(jax.device_get(jnp.ravel(x)[idx[(idx >= i * per) & (idx < (i + 1) * per)]
                                                   - i * per]))
            for i, (_, x) in enumerate(parts)])
        head = f"{key}|{x0.dtype}|{shape}".encode()
        crc = zlib.crc32(sample.tobytes(), zlib.crc32(head, crc))
    return f"{crc:08x}"


def engine_fingerprint(model_config, ec: EngineConfig, draft_vocab_size: int, cache_dtype: str,
                       params, row_width: int | None = None, row_groups: int = 1,
                       linear_state: dict | None = None) -> dict:
    """What two engines must share for a request to move between them: the model config, a
    :func:`params_digest` of the weights, the speculative settings the state depends on (method,
    K, M, draft sampling, verify strategy, n-gram sizes, FR-Spec vocabulary), the KV layout
    (block size, cache dtype, the cache row width ``row_width`` and, when rows carry padding lanes,
    the ``row_groups`` they are padded per, :mod:`jmtp.pallas.kv_layout`: exported pages are
    raw rows, so a TPU engine's padded rows and a CPU engine's unpadded ones do not mix; a
    hybrid model's state layout ``linear_state``, :func:`linear_state_layout`) and the
    sampling-row capacities. Not included (may differ):
    ``max_num_seqs``, ``num_blocks``, ``max_num_batched_tokens``, the attention backend, the
    block allocator, the speculation policy, ``max_model_len`` (checked per request), and the
    model's implementation choices that compute the same function (the MoE experts
    implementation, the MLA path)."""
    spec = ec.spec
    model = json.loads(json.dumps(dataclasses.asdict(model_config), default=str))
    model.pop("mla_path", None)
    model.pop("batch_invariant", None)     # the same function, computed in a fixed order
    if isinstance(model.get("moe"), dict):
        model["moe"].pop("implementation", None)
    kv = dict(block_size=ec.block_size, cache_dtype=cache_dtype,
              kv_cache_dtype=ec.kv_cache_dtype, row_width=row_width, row_groups=row_groups)
    if linear_state is not None:     # (absent for dense models: their fingerprints unchanged)
        kv["linear_state"] = linear_state
    return dict(
        model=model,
        params=params_digest(params),
        spec=dict(method=spec.method, k=ec.k, m=ec.mtp_substeps, draft_sampling=spec.draft_sampling,
                  draft_temperature=spec.draft_temperature, draft_top_p=spec.draft_top_p,
                  draft_top_k=spec.draft_top_k, verify_strategy=spec.verify_strategy,
                  max_candidate_len=spec.max_candidate_len, verify_window=spec.verify_window,
                  ngram_sizes=list(spec.ngram_sizes), draft_vocab_size=int(draft_vocab_size)),
        kv=kv,
        sampling=dict(max_stop_ids=ec.max_stop_ids, max_bad_words=ec.max_bad_words,
                      max_bad_word_len=ec.max_bad_word_len, max_logit_bias=ec.max_logit_bias))


def linear_state_layout(linear, stacked: bool = False) -> dict:
    """The layout of a hybrid model's exported slot state (part of the fingerprint): the shape
    and dtype of ``linear_conv`` / ``linear_recurrent`` (:func:`jmtp.model.state_checkpoints.
    slot_state`) and the checkpoints per slot. ``linear``: the engine's ``LinearState``
    (``stacked``: per data shard, a leading ``data`` axis, :mod:`jmtp.runtime.device.data_parallel`)."""
    lead = 1 if stacked else 0
    conv, rec = linear.conv, linear.recurrent
    cs, rs = tuple(conv.shape)[lead:], tuple(rec.shape)[lead:]
    return dict(conv=[[cs[0]] + list(cs[3:]), str(conv.dtype)],
                recurrent=[[rs[0]] + list(rs[3:]), str(rec.dtype)], checkpoints=int(rs[2]))


def fingerprint_hash(compat: dict) -> str:
    return hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()


def compat_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two :func:`engine_fingerprint` dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += compat_diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k} ({x!r} vs {y!r})")
    return out
