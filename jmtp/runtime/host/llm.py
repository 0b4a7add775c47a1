"""Offline entry point: ``LLM.generate`` / ``LLM.chat``, thin loops over :class:`LLMEngine`.

Data flows one way: config → model/params → state → jitted step → host loop. The host loop lives in
:mod:`jmtp.runtime.host.llm_engine` (admission, chunked prefill, preemption, detokenization, stop
strings); ``LLM`` adds requests, steps until they finish and returns them in input order.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Sequence

import numpy as np

from jmtp.runtime.host.engine_args import default_dtype, with_draft_vocab
from jmtp.runtime.host.handoff import RequestState
from jmtp.runtime.host.llm_engine import LLMEngine
from jmtp.runtime.host.outputs import RequestOutput
from jmtp.runtime.host.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "FirstTokenClock", "RequestState", "SamplingParams",
           "default_dtype", "with_draft_vocab"]

class FirstTokenClock:
    """Time to first token and decode rate of a run of :meth:`LLMEngine.step` calls, with the
    first runs of step buckets met after the first token (lazy compiles,
    ``LLMEngine.first_call_seconds``) left out of the decode time.

    Call :meth:`saw` with every ``RequestOutput`` the run cares about; :attr:`ttft` is then the
    seconds from ``t0`` to the first one that carried a token (None until then).
    """

    def __init__(self, engine: LLMEngine, t0: float | None = None):
        self._engine = engine
        self.t0 = time.perf_counter() if t0 is None else t0
        self.ttft: float | None = None
        self._first_runs_at_ttft = 0.0

    def _first_runs(self) -> float:
        return sum(self._engine.first_call_seconds.values())

    def saw(self, out: RequestOutput) -> None:
        """Note one output; the first with a token fixes :attr:`ttft`."""
        if self.ttft is None and any(c.token_ids for c in out.outputs):
            self.ttft = time.perf_counter() - self.t0
            self._first_runs_at_ttft = self._first_runs()

    def decode_rate(self, tokens_after_first: int, end: float | None = None) -> float:
        """``tokens_after_first`` over the seconds from the first token to ``end`` (default now)
        less the first runs of buckets met in between (tokens/s; 0.0 without such tokens)."""
        if self.ttft is None or tokens_after_first <= 0:
            return 0.0
        end = time.perf_counter() if end is None else end
        after = (end - self.t0 - self.ttft) - (self._first_runs() - self._first_runs_at_ttft)
        return tokens_after_first / after if after > 0 else 0.0


def _engine_attr(name: str) -> property:
    """An attribute of ``LLM`` that is the same attribute of its ``llm_engine``."""
    return property(lambda self: getattr(self.llm_engine, name),
                    lambda self, value: setattr(self.llm_engine, name, value))


class LLM:
    """Offline generation with MTP speculative decoding (vLLM ``LLM`` shape).

    Builds an :class:`LLMEngine` (``llm.llm_engine``, for serving loops) and runs it to completion
    for each :meth:`generate` / :meth:`chat` call. ``llm.last_run_stats`` describes the last call:
    ``steps``, ``seconds`` (wall), ``generated_tokens``, ``tokens_per_second``,
    ``time_to_first_token`` (seconds from the call to the first token of any request, lazy
    compiles included; None when nothing was generated) and ``decode_tokens_per_second`` (the
    tokens after each sample's first, over the time after the first token less the first runs
    of step buckets met after it, i.e. lazy compiles excluded; for one request its decode speed,
    with several the later requests' prefills count in).

    Args:
      model: GGUF file or HF directory; ``None`` = the default SmolLM2-135M-Instruct.
      **engine_args: every keyword of :class:`LLMEngine` (``speculative_config``, ``max_num_seqs``,
        ``max_model_len``, ``block_size``, ``num_blocks``, ``max_num_batched_tokens``, ``dtype``,
        ``attention_backend``, ``moe_backend``, ``block_allocator``, ``kv_cache_dtype``, ``max_logprobs``, ``seed``,
        ``model_config``/``params``/``tokenizer``, ``mtp_head``, ``compile``,
        ``compilation_cache_dir``, ``tensor_parallel_size``, ``data_parallel_size``, ``mesh``,
        ``enable_expert_parallel``, ``all2all_backend``, ``enable_prefix_caching``,
        ``async_scheduling``),
        documented there.

    Raises:
      TypeError: an unknown keyword.
      ValueError: bad configuration (see :class:`EngineConfig`, :class:`SpeculativeConfig`) or an
        unknown model path.
      MapLimitError: the step buckets would not fit in the process's memory-map limit (see
        :class:`LLMEngine`).
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.llm_engine = LLMEngine(model, **engine_args)
        self.last_run_stats: dict = {}
        self._calls = itertools.count()     # request ids of generate calls: generate-<call>-<i>

    # vLLM's ``LLM.model_config`` and ``get_tokenizer()`` counterparts, and ``compile_seconds``
    # (docs/startup.md), read through; everything else is ``llm.llm_engine``'s (``engine_config``,
    # ``spec_policy``, ...) or its runner's (``llm.llm_engine.runner.params``, ``.state``, ...).
    model_config = _engine_attr("model_config")
    tokenizer = _engine_attr("tokenizer")
    compile_seconds = _engine_attr("compile_seconds")

    def kv_cache_bytes(self) -> dict[str, int]:
        """KV-cache bytes, values and scales apart: :meth:`LLMEngine.kv_cache_bytes`."""
        return self.llm_engine.kv_cache_bytes()

    def param_bytes(self) -> dict[str, int]:
        """Parameter bytes, 8-bit values and scales apart: :meth:`LLMEngine.param_bytes`."""
        return self.llm_engine.param_bytes()

    def close(self) -> None:
        """Release the engine: its KV caches, state and compiled executables (and with them the
        memory mappings XLA:CPU holds; :meth:`LLMEngine.close`). Idempotent; the ``LLM`` cannot
        generate after it. ``with jmtp.LLM(...) as llm:`` closes on leaving the block; an ``LLM``
        that is garbage collected releases the same without ``close``."""
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results in input order (``request_id`` = the index).

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          sampling_params: one :class:`SamplingParams` for all prompts, or one per prompt.
          use_tqdm: show a progress bar over finished requests.

        Raises:
          ValueError: empty prompt, prompt not shorter than max_model_len, token ids out of range,
            string prompts without a tokenizer — before anything runs (nothing stays queued).
          RuntimeError: the engine has unfinished requests added through ``llm_engine``.
        """
        prompts, sps = self._prompts_and_params(prompts, sampling_params, "LLM.generate")
        engine = self.llm_engine
        call = next(self._calls)
        ids = [f"generate-{call}-{i}" for i in range(len(prompts))]
        try:
            for i, (rid, p, sp) in enumerate(zip(ids, prompts, sps)):
                engine.requests.add(rid, p, sp, f"prompts[{i}]")
        except BaseException:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _prompts_and_params(self, prompts, sampling_params, where: str):
        """``(list of prompts, one SamplingParams per prompt)``; checks that the engine is idle."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
               else [sampling_params] * len(prompts))
        for i, sp in enumerate(sps):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a jmtp.SamplingParams, got "
                                f"{type(sp).__name__}")
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(sps)} sampling_params for {len(prompts)} prompts")
        self._check_idle(where)
        return prompts, sps

    def _check_idle(self, where: str) -> None:
        engine = self.llm_engine
        engine._check_open()
        if engine.has_unfinished_requests():
            raise RuntimeError(f"{where}: the engine has {engine.get_num_unfinished_requests()}"
                               " unfinished requests added through llm_engine; finish or abort "
                               "them first")

    # ------------------------------------------------------------------ hand-off
    def prefill(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                = None) -> list[RequestState]:
        """Prefill every prompt here (batched, chunked as :meth:`generate` does) and hand each
        request off after its prefill step (which samples its first token and proposes its first
        drafts): one :class:`~jmtp.runtime.host.handoff.RequestState` per prompt, in input order, to
        give to :meth:`import_request` of another ``LLM`` (same model, MTP head and speculative
        config; ``max_num_seqs`` / ``num_blocks`` may differ), possibly in another process
        (``state.to_bytes()`` / ``RequestState.from_bytes``). Nothing stays on this engine.

        Args:
          prompts, sampling_params: as :meth:`generate` (``n`` must be 1).

        Raises:
          ValueError: as :meth:`generate`; ``n > 1``; a device mesh or a custom drafter.
          RuntimeError: the engine has unfinished requests added through ``llm_engine``.
        """
        prompts, sps = self._prompts_and_params(prompts, sampling_params, "LLM.prefill")
        engine = self.llm_engine
        call = next(self._calls)
        ids = [f"prefill-{call}-{i}" for i in range(len(prompts))]
        try:
            for rid, p, sp in zip(ids, prompts, sps):
                engine.add_prefill_request(rid, p, sp)
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException:
            engine.abort_request(ids)
            for rid in ids:
                engine.pop_exported(rid)
            raise
        return [engine.pop_exported(rid) for rid in ids]

    def import_request(self, states: RequestState | Sequence[RequestState], *,
                       use_tqdm: bool = True) -> list[RequestOutput]:
        """Decode requests another ``LLM`` prefilled (:meth:`prefill`) to completion, batched;
        results in input order (``request_id`` = the index, as :meth:`generate`). Each output
        holds every generated token (the exporter's first one included) and the speculation
        counters of the whole request; the first step here already verifies the imported drafts.

        Raises:
          TypeError / ValueError: see :meth:`LLMEngine.import_request` (version, fingerprint,
            ``max_model_len``, capacity), before anything runs.
          RuntimeError: the engine has unfinished requests added through ``llm_engine``.
        """
        states = [states] if isinstance(states, RequestState) else list(states)
        self._check_idle("LLM.import_request")
        engine = self.llm_engine
        for i, st in enumerate(states):
            if not isinstance(st, RequestState):
                raise TypeError(f"states[{i}] must be a jmtp RequestState, got "
                                f"{type(st).__name__}")
        # This LLM's own ids: states from different prefill LLMs may carry the same request_id.
        call = next(self._calls)
        ids = [f"import-{call}-{i}" for i in range(len(states))]
        try:
            for rid, st in zip(ids, states):
                engine.import_request(st, request_id=rid)
        except BaseException:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Chat with the model: each conversation is rendered with the model's chat template
        (``tokenizer.apply_chat_template``) and generated as in :meth:`generate`.

        Args:
          messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a
            list of conversations.
          sampling_params: as in :meth:`generate`.
          add_generation_prompt: end the prompt with the assistant turn's header.
          chat_template_kwargs: extra variables for the template.

        Returns:
          one :class:`RequestOutput` per conversation, in order.

        Raises:
          ValueError: no tokenizer / chat template, malformed messages, or as :meth:`generate`.
        """
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts or a "
                             "list of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        stats0 = engine.get_stats()
        t0, steps0, gen0 = time.perf_counter(), stats0["num_steps"], stats0["num_generated_tokens"]
        clock = FirstTokenClock(engine, t0)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    clock.saw(out)
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        dt = time.perf_counter() - t0
        stats = engine.get_stats()
        gen = stats["num_generated_tokens"] - gen0
        # Decode rate: the tokens after each sample's first one.
        firsts = sum(1 for rid in ids if rid in done for c in done[rid].outputs if c.token_ids)
        self.last_run_stats = dict(steps=stats["num_steps"] - steps0, seconds=dt,
                                   generated_tokens=gen,
                                   tokens_per_second=gen / dt if dt > 0 else 0.0,
                                   time_to_first_token=clock.ttft,
                                   decode_tokens_per_second=clock.decode_rate(gen - firsts,
                                                                              t0 + dt))
        return [dataclasses.replace(done[rid], request_id=i) for i, rid in enumerate(ids)]
