"""The engine side of the prefill → decode hand-off (:mod:`jmtp.runtime.host.handoff` holds the
``RequestState`` format and the device functions).

Export reads a slot's state row and KV pages to the host as full (unsharded) arrays and import
writes them into a slot of another engine, so the two engines may run on different meshes
(tensor parallelism 2 → 1, 1 → 2, data parallelism on either side): what must match is the
:func:`~jmtp.runtime.host.handoff.engine_fingerprint` (model, weights, speculative settings, KV
layout, sampling capacities), not the placement.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.handoff import (HANDOFF_VERSION, RequestState, compat_diff,
                                       engine_fingerprint, fingerprint_hash, linear_state_layout)
from jmtp.runtime.host.requests import RequestTable, Sequence
from jmtp.runtime.host.sampling_params import SamplingParams


class HandOff:
    """Exported states waiting to be collected, and the export / import checks of one engine.

    Args:
      runner: the engine's :class:`~jmtp.runtime.device.runner.DeviceRunner`.
      requests: its :class:`~jmtp.runtime.host.requests.RequestTable`.
      draft_vocab_size: the FR-Spec draft vocabulary in use (part of the fingerprint).
    """

    def __init__(self, runner, requests: RequestTable, draft_vocab_size: int):
        self.runner, self.requests, self.draft_vocab_size = runner, requests, draft_vocab_size
        self.exported: dict[str, RequestState] = {}
        self._compat: dict | None = None

    def check(self, where: str) -> None:
        """Raise ``ValueError`` if this engine cannot hand requests off."""
        ec = self.runner.engine_config
        if ec.spec.method == "custom":
            raise ValueError(f"{where}: the hand-off does not support a custom drafter")
        if ec.enable_prefix_caching:
            raise ValueError(f"{where}: the hand-off does not support enable_prefix_caching=True "
                             "yet (a slot's shared prefix blocks are not exported)")

    def compat(self) -> dict:
        """This engine's :func:`~jmtp.runtime.host.handoff.engine_fingerprint` (computed once)."""
        if self._compat is None:
            r = self.runner
            width = int(r.cache.k.shape[-1])
            mc = r.model_config
            padded = not mc.is_mla and width != mc.num_kv_heads * mc.head_dim
            lin = getattr(r.cache, "linear", None)
            self._compat = engine_fingerprint(mc, r.engine_config, self.draft_vocab_size,
                                              str(r.cache.k.dtype), r.params, width,
                                              getattr(r, "tensor_parallel_size", 1) if padded
                                              else 1,
                                              None if lin is None else linear_state_layout(
                                                  lin, stacked=r.mesh is not None))
        return self._compat

    def export(self, seq: Sequence) -> RequestState:
        """The :class:`RequestState` of ``seq``: with its slot's row and KV pages while it runs
        (the caller frees the slot next), without them once it finished."""
        g, ec = seq.group, self.runner.engine_config
        compat = self.compat()
        row, kv, text = {}, {}, ""
        if seq.finish_reason is None:
            row, kv = self.runner.export_slot(seq.slot)
            row["input_ids"] = row["input_ids"][:int(row["prompt_lens"]) + int(row["step_idx"])]
        else:
            text = self.requests.completion(seq).text
        return RequestState(
            version=HANDOFF_VERSION, fingerprint=fingerprint_hash(compat), compat=compat,
            request_id=g.request_id, prompt=g.prompt, prompt_token_ids=list(g.prompt_ids),
            sampling_params=seq.params, bad_words_ids=[list(w) for w in g.bad_words_ids],
            output_token_ids=list(seq.output_ids),
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            metrics=dataclasses.replace(
                seq.metrics, accepted_per_position=list(seq.metrics.accepted_per_position)),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, text=text,
            max_model_len=ec.max_model_len, row=row, kv=kv)

    def check_import(self, state: RequestState, rid: str) -> None:
        """Raise ``ValueError`` (the message names the difference) if ``state`` cannot continue
        here as request ``rid`` (see :meth:`LLMEngine.import_request`)."""
        where = f"import_request({rid!r})"
        if state.version != HANDOFF_VERSION:
            raise ValueError(f"{where}: RequestState.version={state.version}, this engine reads "
                             f"version {HANDOFF_VERSION}")
        compat = self.compat()
        if state.fingerprint != fingerprint_hash(compat):
            diff = compat_diff(state.compat, compat) or ["fingerprint"]
            raise ValueError(f"{where}: the request was exported by an incompatible engine; "
                             f"differs in: {'; '.join(diff)}")
        ec, sp = self.runner.engine_config, state.sampling_params
        if getattr(sp, "structured_outputs", None) is not None:
            raise InvalidRequestError(f"{where}: the hand-off does not carry a grammar state "
                                      "(structured_outputs)", "structured_outputs")
        if rid in self.requests.groups:
            raise ValueError(f"{where}: request_id {rid!r} is already in use by an "
                             "unfinished request")
        prompt_ids = list(state.prompt_token_ids)
        end = len(prompt_ids) + sp.max_tokens
        if min(end, ec.max_model_len) != min(end, state.max_model_len):
            raise ValueError(f"{where}: max_model_len={ec.max_model_len} would stop the request "
                             f"at another length than the exporter's max_model_len="
                             f"{state.max_model_len} (prompt {len(prompt_ids)} + max_tokens "
                             f"{sp.max_tokens} tokens)")
        if (sp.stop or sp.bad_words) and self.requests.tokenizer is None:
            raise ValueError(f"{where}: stop strings / bad words need a tokenizer")
        self.requests.validate(prompt_ids, sp, where)
        if state.finished:
            return
        missing = sorted(self.runner.row_keys() - set(state.row))
        if missing:
            raise ValueError(f"{where}: RequestState.row lacks {', '.join(missing)} (written "
                             "by another jmtp layout)")
        if state.num_pages > ec.pages_per_seq:
            raise ValueError(f"{where}: {state.num_pages} KV pages exceed pages_per_seq="
                             f"{ec.pages_per_seq}")
        layout = compat["kv"].get("linear_state")
        if layout is not None:        # a hybrid model's slot state, as the fingerprint says
            want = {"linear_conv": layout["conv"], "linear_recurrent": layout["recurrent"],
                    "linear_current": [[], "int32"]}
            for name, (shape, dtype) in want.items():
                a = state.kv.get(name)
                if a is None or list(a.shape) != list(shape) or str(a.dtype) != dtype:
                    got = None if a is None else f"{list(a.shape)} {a.dtype}"
                    raise ValueError(f"{where}: RequestState.kv[{name!r}] must be {shape} "
                                     f"{dtype} (the recurrent state of a hybrid model), got {got}")
        if state.row["input_ids"].shape[0] > ec.seq_buffer_len:
            raise ValueError(f"{where}: {state.row['input_ids'].shape[0]} tokens exceed the "
                             f"token buffer ({ec.seq_buffer_len})")

    def admit(self, b: int, seq: Sequence) -> int:
        """Write an imported request into idle slot ``b``; returns the drafts waiting in its
        window.

        Raises:
          RuntimeError: the allocator could not give the slot its blocks (the scheduler checks
            the free count first, so this means a bug).
        """
        ec, st = self.runner.engine_config, seq.handoff
        row = dict(st.row)
        ids = np.zeros((ec.seq_buffer_len,), np.int32)
        ids[:row["input_ids"].shape[0]] = row["input_ids"]
        row["input_ids"] = ids
        if not self.runner.import_slot(b, row, st.kv, st.num_pages):
            raise RuntimeError(f"import of request {seq.group.request_id!r}: the allocator could "
                               f"not give slot {b} its {st.num_pages} KV blocks")
        seq.handoff = None                 # a later preemption recomputes as usual
        seq.prefilled = len(seq.context_ids)
        seq.resuming = False
        return int(np.sum(row["draft_tokens"][1:] >= 0))


class HandOffAPI:
    """The hand-off methods of :class:`~jmtp.runtime.host.llm_engine.LLMEngine` (a base class of it:
    they use its ``handoff``, ``requests``, :meth:`step` and :meth:`abort_request`)."""

    def prefill_request(self, request_id: str, prompt: str | list[int],
                        sampling_params: SamplingParams | None = None) -> RequestState:
        """Run a request's prefill here and hand it off (:class:`RequestState`: its state row,
        target and MTP KV pages, tokens, sampling state); its slot and blocks are freed here and
        :meth:`import_request` on another engine (same model, head and speculative config, any
        mesh) continues it. A request that finishes during the prefill comes back finished,
        without KV pages. Arguments as :meth:`add_request`.

        Raises:
          ValueError: as :meth:`add_request`; ``sampling_params.n > 1``; a custom drafter or
            prefix caching (not supported by the hand-off).
          RuntimeError: the engine has other unfinished requests (this call runs steps).
        """
        self.handoff.check("prefill_request")
        if self.has_unfinished_requests():
            raise RuntimeError(f"prefill_request: the engine has "
                               f"{self.get_num_unfinished_requests()} unfinished requests; finish "
                               "or abort them first")
        self.add_prefill_request(request_id, prompt, sampling_params)
        try:
            while request_id not in self.handoff.exported:
                self.step()
        except BaseException:
            self.abort_request(request_id)
            raise
        return self.handoff.exported.pop(request_id)

    def add_prefill_request(self, request_id: str, prompt: str | list[int],
                            sampling_params: SamplingParams | None = None) -> None:
        """Queue a request to be handed off after its prefill (batched with the others by the
        following :meth:`step` calls, which return no output for it); collect the states with
        :meth:`pop_exported`.

        Raises:
          ValueError: as :meth:`prefill_request`.
        """
        self.handoff.check("add_prefill_request")
        sp = sampling_params or SamplingParams()
        if isinstance(sp, SamplingParams) and sp.n != 1:
            raise ValueError(f"request {request_id!r}: the hand-off supports n=1 only, got "
                             f"SamplingParams.n={sp.n}")
        if isinstance(sp, SamplingParams) and sp.prompt_logprobs is not None:
            raise InvalidRequestError(
                f"request {request_id!r}: the hand-off does not carry prompt logprobs; run "
                "prompt_logprobs requests on one engine", "prompt_logprobs")
        if isinstance(sp, SamplingParams) and sp.structured_outputs is not None:
            raise InvalidRequestError(
                f"request {request_id!r}: the hand-off does not carry a grammar state yet; run "
                "structured-output requests on one engine", "structured_outputs")
        self.requests.add(request_id, prompt, sampling_params,
                          f"request {request_id!r}").export = True

    def pop_exported(self, request_id: str) -> RequestState | None:
        """The state of a request handed off by :meth:`add_prefill_request` (None while it still
        prefills; each state is returned once)."""
        return self.handoff.exported.pop(request_id, None)

    def import_request(self, state: RequestState, request_id: str | None = None) -> None:
        """Continue a request exported by another engine's :meth:`prefill_request`.

        It joins the running batch at the next :meth:`step` once the free KV blocks of a data
        shard cover its pages (FIFO with the other waiting requests); its pages are copied into
        blocks of this engine and its row is written in one jitted call. Its outputs carry all
        its tokens and its speculation counters. A state that finished on the exporter is
        returned, finished, by the next :meth:`step`. ``request_id`` names it here (default:
        the exporter's ``state.request_id``).

        Raises:
          TypeError: ``state`` not a :class:`RequestState`.
          ValueError: another layout version; another model, weights, speculative config or KV
            layout (the message names the differences); a ``max_model_len`` that would stop the
            request elsewhere; the request does not fit this engine; a ``request_id`` in use.
        """
        if not isinstance(state, RequestState):
            raise TypeError(f"import_request: state must be a jmtp RequestState, got "
                            f"{type(state).__name__}")
        self.handoff.check("import_request")
        rid = state.request_id if request_id is None else request_id
        self.handoff.check_import(state, rid)
        self.requests.imported(state, rid)


__all__ = ["HandOff", "HandOffAPI"]
