"""``RequestTable``: the engine's requests on the host (no device arrays, no XLA).

A request is a :class:`SequenceGroup` of ``n`` :class:`Sequence` s (vLLM's names); each sequence
runs in one batch slot. The table validates requests when they arrive (every error an
:class:`~jmtp.core.errors.InvalidRequestError` naming the field), keeps the FIFO of waiting
sequences, turns each step's emitted tokens into text (incremental detokenizing, stop strings,
logprobs, speculation metrics) and assembles the :class:`~jmtp.runtime.host.outputs.RequestOutput` s.
Which slot a sequence runs in, and when, is the :class:`~jmtp.runtime.host.scheduler.Scheduler`'s job.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.model.config import ModelConfig
from jmtp.pallas.block_allocator import blocks_needed
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.state import FINISH_REASONS
from jmtp.runtime.host.detokenizer import IncrementalDetokenizer
from jmtp.runtime.host.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.host.sampling_rows import make_row
from jmtp.runtime.host.structured.grammar import SequenceGrammar
from jmtp.runtime.host.structured.manager import StructuredOutputs


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request seeded with ``seed``: ``seed`` itself for sample 0,
    else a ``numpy.random.SeedSequence((seed mod 2**64, index))`` draw (distinct, reproducible
    streams)."""
    if index == 0:
        return int(seed)
    return int(np.random.SeedSequence((int(seed) & (2**64 - 1), int(index))).generate_state(1)[0])


@dataclasses.dataclass
class Sequence:
    """One sample of a request: what one batch slot runs."""

    group: "SequenceGroup"
    index: int
    params: SamplingParams         # the request's params with this sample's seed
    detok: IncrementalDetokenizer | None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    metrics: SpecDecodeMetrics = dataclasses.field(default_factory=SpecDecodeMetrics)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""                 # visible text (stop-string cut applied once finished)
    checked: int = 0               # detokenized characters already searched for stop strings
    stop_floor: int = 0            # characters of the first min_tokens tokens: no stop string
                                   # may end inside them (vLLM)
    # per admission
    slot: int | None = None
    context_ids: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    resuming: bool = False         # the finishing prefill re-emits output_ids[-1]
    # prefix caching (per admission): the cached blocks the slot reads, the tokens the device
    # holds (context + every emitted token), and how many positions the target / MTP caches
    # hold correctly
    prefix_keys: list[bytes] = dataclasses.field(default_factory=list)
    device_ids: list[int] = dataclasses.field(default_factory=list)
    dev_decoded: int = 0
    mtp_valid: int = 0
    # hybrid models (jmtp.runtime.host.prefix_states): the state entry the slot captures into, the
    # block boundary it holds, and a boundary to capture before anything past it (0: none)
    state_entry: int = -1
    state_pos: int = 0
    state_target: int = 0
    handoff: object | None = None  # an imported RequestState to admit (jmtp.runtime.host.handoff)
    # structured outputs: the sample's grammar state over its output (None: unconstrained)
    grammar: SequenceGrammar | None = None
    # reported so far
    sent_tokens: int = 0
    sent_text: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.group.prompt_ids

    @property
    def prefilling(self) -> bool:
        """Part of the context is still to be prefilled."""
        return self.prefilled < len(self.context_ids)


@dataclasses.dataclass
class SequenceGroup:
    """One request: its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    bad_words_ids: list[list[int]]
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    # stop strings that are a special token's text, by token id: they match the token itself
    # (with skip_special_tokens its text never reaches the output)
    special_stops: dict[int, str] = dataclasses.field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt position (None until computed; the
    # first stays None)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    export: bool = False           # hand off after the prefill (LLMEngine.add_prefill_request)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class RequestTable:
    """Unfinished requests, the waiting FIFO and the cumulative output counters.

    Args:
      model_config / engine_config: the engine's (vocabulary, EOS ids, capacities).
      tokenizer: a :class:`~jmtp.model.checkpoints.tokenizer.Tokenizer` or None (token-id prompts only).
      seed: seeds the per-sample seeds of requests whose ``SamplingParams.seed`` is None.
      prompt_logprobs: the runner returns prompt logprobs (one device; a mesh refuses
        ``SamplingParams.prompt_logprobs``).

    Attributes: ``groups`` (``{request_id: SequenceGroup}``), ``waiting`` (``deque`` of
    sequences, FIFO), ``ready`` (imported groups that had already finished), ``totals`` (a
    :class:`SpecDecodeMetrics` over every sample ever run), ``num_generated`` (tokens kept).
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, tokenizer,
                 seed: int = 0, prompt_logprobs: bool = True):
        self.serves_prompt_logprobs = prompt_logprobs
        self.model_config, self.engine_config, self.tokenizer = model_config, engine_config, tokenizer
        self._seed_rng = np.random.default_rng(seed)
        self.groups: dict[str, SequenceGroup] = {}
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.ready: list[SequenceGroup] = []
        self.totals = SpecDecodeMetrics(accepted_per_position=[0] * engine_config.k)
        self.num_generated = 0
        specials = getattr(tokenizer, "special_token_ids", None)
        self._special_ids: dict[str, int] = specials() if specials is not None else {}
        spec = engine_config.spec
        self.structured = StructuredOutputs(
            tokenizer, model_config.vocab_size, model_config.eos_token_ids, engine_config.window,
            draft_sampling=bool(spec.enabled and spec.draft_sampling),
            verify_strategy=spec.verify_strategy)

    def _detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer | None:
        return (IncrementalDetokenizer(self.tokenizer, skip_special_tokens)
                if self.tokenizer is not None else None)

    # ------------------------------------------------------------------ intake
    def add(self, request_id, prompt, sp: SamplingParams | None, where: str) -> SequenceGroup:
        """Validate and queue a request (see :meth:`LLMEngine.add_request` for the errors)."""
        if not isinstance(request_id, str):
            raise TypeError(f"{where}: request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.groups:
            raise InvalidRequestError(f"{where}: request_id {request_id!r} is already in use by "
                                      "an unfinished request", "request_id")
        if sp is None:
            sp = SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be a jmtp.SamplingParams, got "
                            f"{type(sp).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where}: string prompt but the engine has no "
                                          "tokenizer", "prompt")
            ids, text = list(self.tokenizer.encode(prompt)), prompt
        else:
            try:
                arr = np.asarray(prompt)
            except ValueError:          # ragged nested lists
                arr = np.asarray([None], dtype=object)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InvalidRequestError(f"{where}: a token-id prompt must be a flat list of "
                                          f"ints, got {arr.dtype} with shape {arr.shape}",
                                          "prompt")
            ids, text = [int(t) for t in arr], None
        if sp.stop and self.tokenizer is None:
            raise InvalidRequestError(f"{where}: stop strings need a tokenizer (use "
                                      "stop_token_ids)", "stop")
        self.validate(ids, sp, where)
        group = SequenceGroup(request_id, text, ids, sp,
                              self.bad_words_ids(sp) if sp.bad_words else [],
                              special_stops={self._special_ids[s]: s for s in sp.stop
                                             if s in self._special_ids},
                              prompt_logprobs=(None if sp.prompt_logprobs is None
                                               else [None] * len(ids)))
        for i in range(sp.n):
            seed = (sample_seed(sp.seed, i) if sp.seed is not None
                    else int(self._seed_rng.integers(0, 2**32)))
            group.seqs.append(Sequence(group, i, dataclasses.replace(sp, seed=seed),
                                       self._detokenizer(sp.skip_special_tokens),
                                       context_ids=list(ids),
                                       logprobs=[] if sp.logprobs is not None else None,
                                       grammar=self._grammar(sp, group.bad_words_ids)))
        self.groups[request_id] = group
        self.waiting.extend(group.seqs)
        return group

    def _grammar(self, sp: SamplingParams, bad_words_ids) -> SequenceGrammar | None:
        """A sample's grammar state (None when unconstrained); the ids the request bans
        everywhere (``bad_token_ids``, one-token bad words) are cleared from its masks."""
        if sp.structured_outputs is None:
            return None
        g = self.structured.matcher(sp.structured_outputs)
        g.banned = tuple(sorted({int(t) for t in sp.bad_token_ids}
                                | {w[0] for w in bad_words_ids if len(w) == 1}))
        return g

    def validate(self, prompt_ids: list[int], sp: SamplingParams, where: str) -> None:
        """Raise :class:`InvalidRequestError` (naming the field) for a request this engine cannot
        run: empty or too long prompt, ids outside the vocabulary, more KV blocks than exist,
        ``logprobs`` above ``max_logprobs``, bad words without a tokenizer, or a sampling row
        over the engine's capacities, or a structured-output constraint the grammar engine
        rejects (or no tokenizer to apply it with)."""
        ec, mc = self.engine_config, self.model_config
        if len(prompt_ids) == 0:
            raise InvalidRequestError(f"{where}: prompt is empty (a prompt needs at least one "
                                      "token)", "prompt")
        if len(prompt_ids) >= ec.max_model_len:
            raise InvalidRequestError(
                f"{where}: prompt has {len(prompt_ids)} tokens; max_model_len={ec.max_model_len} "
                "leaves no room to generate (prompt must be shorter than max_model_len)", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise InvalidRequestError(f"{where}: token id {bad[0]} outside [0, vocab_size="
                                      f"{mc.vocab_size})", "prompt")
        need = blocks_needed(min(len(prompt_ids) + sp.max_tokens, ec.max_model_len) + ec.k + ec.mtp_substeps,
                             ec.block_size)
        if need > ec.num_blocks:
            raise InvalidRequestError(
                f"{where}: the request needs up to {need} KV blocks but num_blocks={ec.num_blocks}",
                "max_tokens")
        if sp.num_speculative_tokens is not None and sp.num_speculative_tokens > ec.k:
            raise InvalidRequestError(
                f"{where}: num_speculative_tokens={sp.num_speculative_tokens} exceeds the "
                f"engine's num_speculative_tokens={ec.k} (a request may only lower it)",
                "num_speculative_tokens")
        if sp.logprobs is not None and max(sp.logprobs, 1) > ec.max_logprobs:
            raise InvalidRequestError(f"{where}: logprobs={sp.logprobs} exceeds max_logprobs="
                                      f"{ec.max_logprobs} (set LLM(max_logprobs=...))", "logprobs")
        if sp.prompt_logprobs is not None:
            if not self.serves_prompt_logprobs:
                raise InvalidRequestError(f"{where}: prompt_logprobs are not served on a device "
                                          "mesh", "prompt_logprobs")
            if max(sp.prompt_logprobs, 1) > ec.max_logprobs:
                raise InvalidRequestError(f"{where}: prompt_logprobs={sp.prompt_logprobs} exceeds "
                                          f"max_logprobs={ec.max_logprobs} (set "
                                          "LLM(max_logprobs=...))", "prompt_logprobs")
        if sp.bad_words and self.tokenizer is None:
            raise InvalidRequestError(f"{where}: bad_words need a tokenizer (use bad_token_ids)",
                                      "bad_words")
        if sp.structured_outputs is not None:   # compiles (cached): a bad grammar fails here
            self.structured.check(sp.structured_outputs, where)
        # Builds (and so validates) the sampling row: stop ids, bad words, capacities.
        self.sampling_row(sp, prompt_ids, self.bad_words_ids(sp), 0)

    def bad_words_ids(self, sp: SamplingParams) -> list[list[int]]:
        """Token ids of each bad word and of its space-prefixed form (as vLLM does)."""
        out = []
        for wd in sp.bad_words:
            for variant in (wd, " " + wd.lstrip()):
                ids = list(self.tokenizer.encode(variant))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def device_params(self, sp: SamplingParams) -> SamplingParams:
        """``sp`` with ``max_tokens`` and ``min_tokens`` capped at ``max_model_len``, as the
        device gets them (i32): a sample never runs past ``max_model_len`` tokens, so the cap
        changes nothing it does, and any int a caller sends fits the device's arrays."""
        cap = self.engine_config.max_model_len
        if sp.max_tokens <= cap and sp.min_tokens <= cap:
            return sp
        return dataclasses.replace(sp, max_tokens=min(sp.max_tokens, cap),
                                   min_tokens=min(sp.min_tokens, cap))

    def sampling_row(self, sp, prompt_ids, bad_words_ids, seed) -> dict:
        """One row of the device's sampling arrays (:func:`jmtp.runtime.host.sampling_rows.make_row`)."""
        ec = self.engine_config
        return make_row(self.device_params(sp), prompt_ids, self.model_config.vocab_size, max_stop=ec.max_stop_ids,
                        max_bad_words=ec.max_bad_words, max_bad_word_len=ec.max_bad_word_len,
                        max_logit_bias=ec.max_logit_bias, eos_ids=self.model_config.eos_token_ids,
                        request_seed=seed, bad_words_ids=bad_words_ids)

    def admission_row(self, seq: Sequence) -> tuple[np.ndarray, dict, int, int]:
        """What the device insert of ``seq`` needs: ``(ids i32[seq_buffer_len]`` (its context,
        padded), its sampling row, the tokens left to generate, the resume token)``. A preempted
        sequence (it has output) is re-admitted with its prompt and all but its last generated
        token as context, the last one as resume token, and the sampling state its history
        implies (penalty counts, ``min_tokens`` left, recent tokens, random-stream offset); a
        new one gets resume token -1. Sets ``seq.context_ids``."""
        ec, g = self.engine_config, seq.group
        resume = bool(seq.output_ids)
        hist = seq.output_ids[:-1] if resume else []
        seq.context_ids = g.prompt_ids + hist
        ids = np.zeros((ec.seq_buffer_len,), np.int32)
        ids[: len(seq.context_ids)] = seq.context_ids
        row = self.sampling_row(seq.params, g.prompt_ids, g.bad_words_ids, None)
        if hist:
            row["output_counts"] += np.bincount(
                hist, minlength=self.model_config.vocab_size).astype(np.int32)
            row["min_tokens"] = np.int32(max(seq.params.min_tokens - len(hist), 0))
            tail = np.asarray(seq.context_ids[-(ec.max_bad_word_len - 1):]
                              if ec.max_bad_word_len > 1 else [], np.int32)
            row["recent_tokens"][ec.max_bad_word_len - 1 - tail.size:] = tail
        row["rng_offset"] = np.int32(len(hist))
        return (ids, row, self.device_params(seq.params).max_tokens - len(hist),
                seq.output_ids[-1] if resume else -1)

    def imported(self, state, rid: str) -> Sequence:
        """The group and sequence of a :class:`~jmtp.runtime.host.handoff.RequestState` (already
        checked against this engine), registered under ``rid``: finished ones go to
        :attr:`ready`, the others to the waiting FIFO."""
        sp, prompt_ids = state.sampling_params, list(state.prompt_token_ids)
        group = SequenceGroup(rid, state.prompt, prompt_ids, sp,
                              [list(w) for w in state.bad_words_ids],
                              special_stops={self._special_ids[s]: s for s in sp.stop
                                             if s in self._special_ids})
        seq = Sequence(group, 0, sp, self._detokenizer(sp.skip_special_tokens),
                       output_ids=list(state.output_token_ids),
                       metrics=dataclasses.replace(
                           state.metrics,
                           accepted_per_position=list(state.metrics.accepted_per_position)),
                       logprobs=None if state.logprobs is None else list(state.logprobs),
                       context_ids=prompt_ids + list(state.output_token_ids[:-1]))
        if seq.detok is not None:
            seq.detok.push(seq.output_ids)
            seq.checked = len(seq.detok.text)
            if len(seq.output_ids) <= sp.min_tokens:
                seq.stop_floor = seq.checked
        group.seqs.append(seq)
        self.groups[rid] = group
        if state.finished:
            seq.finish_reason, seq.stop_reason, seq.text = (state.finish_reason,
                                                            state.stop_reason, state.text)
            self.ready.append(group)
        else:
            seq.handoff = state
            self.waiting.append(seq)
        return seq

    def forget(self, group: SequenceGroup) -> None:
        """Drop a request from the table (its slots must be freed already)."""
        self.waiting = collections.deque(s for s in self.waiting if s.group is not group)
        self.ready = [g for g in self.ready if g is not group]
        self.groups.pop(group.request_id, None)

    # ------------------------------------------------------------------ tokens
    def append(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """Add ``tokens`` to ``seq``, detokenizing one token at a time so a stop string that
        completes inside a multi-token step is caught at its token. Returns ``(tokens kept,
        matched stop string or None)``; tokens after the one completing a stop string are
        dropped. As vLLM: no stop string ends the output before ``min_tokens`` tokens (one must
        end in the text of a later token). A stop string that is a special token's text matches
        that token (its text is not in the output when ``skip_special_tokens``)."""
        sp = seq.params
        stops = sp.stop
        if seq.detok is None:
            seq.output_ids += tokens
            return len(tokens), None
        for i, t in enumerate(tokens):
            seq.output_ids.append(t)
            seq.detok.push([t])
            if not stops:
                continue
            text = seq.detok.text
            if len(seq.output_ids) <= sp.min_tokens:
                seq.checked = seq.stop_floor = len(text)
                continue
            special = seq.group.special_stops.get(t)
            if special is not None and sp.skip_special_tokens:
                seq.checked = len(text)
                seq.text = text + special if sp.include_stop_str_in_output else text
                return i + 1, special
            longest = max(len(s) for s in stops)
            start = max(0, seq.checked - longest + 1)
            hits = [(j, s) for s in stops
                    if (j := text.find(s, max(start, seq.stop_floor - len(s) + 1))) >= 0]
            seq.checked = len(text)
            if hits:
                j, s = min(hits)
                end = j + len(s) if seq.params.include_stop_str_in_output else j
                seq.text = text[:end]
                return i + 1, s
        return len(tokens), None

    def record(self, seq: Sequence, out, b: int, first: int, n: int, was_decode: bool,
               abort: str | None = None) -> int:
        """Take slot ``b``'s tokens ``out.tokens[b, first:n]`` of a step into ``seq``: append
        them (:meth:`append`), collect their logprobs, count the decode metrics, and finish
        ``seq`` on a stop string, else with ``"abort"`` and ``stop_reason=abort`` when
        ``abort`` is given (``n`` then stops before a token the engine refuses to emit), else
        when the step finished the slot (``finish_reason``, ``stop_reason``: the string, or the
        stop token id). Returns the tokens kept."""
        kept, stop = self.append(seq, [int(x) for x in out.tokens[b, first:n]])
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif abort is not None:
            seq.finish_reason, seq.stop_reason = "abort", abort
        elif out.finished[b]:
            seq.finish_reason = FINISH_REASONS[int(out.finish_reason[b])]
            last = seq.output_ids[-1] if seq.output_ids else None
            if seq.finish_reason == "stop" and last in seq.params.stop_token_ids:
                seq.stop_reason = last
        if seq.logprobs is not None and kept:
            k = seq.params.logprobs   # vLLM shape: top-k plus the token itself, per token
            for i in range(first, first + kept):
                d = {int(t): float(v) for t, v in zip(out.top_logprob_ids[b, i, :k],
                                                       out.top_logprobs[b, i, :k])}
                d[int(out.tokens[b, i])] = float(out.logprobs[b, i])
                seq.logprobs.append(d)
        self.num_generated += kept
        if was_decode and n:
            a = min(int(out.num_accepted[b]), kept)   # drafts cut by a stop string do not count
            d = int(out.num_drafts[b])
            for m in (seq.metrics, self.totals):
                m.num_decode_steps += 1
                m.num_decode_tokens += kept
                m.num_draft_tokens += d
                m.num_accepted_tokens += a
                m.max_drafts_per_step = max(m.max_drafts_per_step, d)
                for i in range(a):
                    m.accepted_per_position[i] += 1
        return kept

    def record_prompt_logprobs(self, seq: Sequence, out, b: int, start: int, chunk: int) -> None:
        """Keep the prompt logprobs of slot ``b``'s prefill rows ``start .. start + chunk - 1``
        (context positions) of a step (:mod:`jmtp.runtime.device.prompt_logprobs`): row ``p`` gives
        the logprob of prompt token ``p + 1`` and the row's top ``prompt_logprobs``."""
        g = seq.group
        if g.prompt_logprobs is None or out.prompt_logprobs is None or not chunk:
            return
        k = g.params.prompt_logprobs
        row0 = int(out.prompt_row_start[b])
        for r in range(chunk):
            q = start + r + 1                    # the prompt position row r predicts
            if not 1 <= q < len(g.prompt_ids) or g.prompt_logprobs[q] is not None:
                continue
            i = row0 + r
            d = {int(t): float(v) for t, v in zip(out.prompt_top_ids[i, :k],
                                                   out.prompt_top_logprobs[i, :k])}
            d[int(g.prompt_ids[q])] = float(out.prompt_logprobs[i])
            g.prompt_logprobs[q] = d

    def stats(self) -> dict:
        """Request and token counters of ``LLMEngine.get_stats``."""
        t = self.totals
        return dict(num_unfinished_requests=len(self.groups), num_waiting=len(self.waiting),
                    num_generated_tokens=self.num_generated, num_draft_tokens=t.num_draft_tokens,
                    num_accepted_tokens=t.num_accepted_tokens,
                    accepted_per_position=list(t.accepted_per_position),
                    num_decode_steps=t.num_decode_steps, num_decode_tokens=t.num_decode_tokens)

    # ------------------------------------------------------------------ outputs
    def make_output(self, g: SequenceGroup) -> RequestOutput:
        """The group's :class:`RequestOutput` (deltas since the last one); a finished group is
        forgotten."""
        outs = []
        metrics = SpecDecodeMetrics(accepted_per_position=[0] * self.engine_config.k)
        for seq in g.seqs:
            metrics.merge(seq.metrics)
            outs.append(self.completion(seq))
        finished = g.finished
        if finished:
            self.groups.pop(g.request_id, None)
        return RequestOutput(request_id=g.request_id, prompt=g.prompt,
                             prompt_token_ids=list(g.prompt_ids), outputs=outs, finished=finished,
                             metrics=metrics, prompt_logprobs=(
                                 None if g.prompt_logprobs is None else list(g.prompt_logprobs)))

    def pop_ready(self) -> list[RequestOutput]:
        """The outputs of imported requests that had already finished; forgets them."""
        ready = [self.make_output(g) for g in self.ready]
        self.ready = []
        return ready

    def completion(self, seq: Sequence) -> CompletionOutput:
        """``seq``'s :class:`CompletionOutput`: full text and ids, and the deltas since the last
        call (text that could still start a stop string is held back until it cannot)."""
        if seq.detok is not None and not (seq.finish_reason == "stop"
                                          and isinstance(seq.stop_reason, str)):
            # (a matched stop string already set the final, cut text in append)
            if seq.finish_reason is not None:
                seq.detok.flush()          # characters that never completed, as decode gives them
                seq.text = seq.detok.text
            else:
                text = seq.detok.text
                if seq.params.stop and not seq.params.include_stop_str_in_output:
                    text = text[:max(len(text) - max(len(s) for s in seq.params.stop) + 1,
                                     seq.sent_text)]
                seq.text = text
        delta_ids = seq.output_ids[seq.sent_tokens:]
        delta_text = seq.text[seq.sent_text:]
        seq.sent_tokens, seq.sent_text = len(seq.output_ids), len(seq.text)
        return CompletionOutput(
            index=seq.index, text=seq.text, token_ids=list(seq.output_ids), delta_text=delta_text,
            delta_token_ids=list(delta_ids), finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None)


__all__ = ["Sequence", "SequenceGroup", "RequestTable", "sample_seed"]
