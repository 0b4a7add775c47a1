"""The engine's structured-output wiring: one bitmask and draft override per slot and step.

:class:`StructuredOutputs` belongs to the request table: it checks and compiles each request's
constraint when the request is added (so a bad schema fails before it runs), gives every sample
its :class:`~jmtp.runtime.host.structured.grammar.SequenceGrammar`, and before each step builds the
step's ``(token_bitmask i32[B, K+1, NW], draft_override i32[B, K])`` from the slots' grammar
states and the drafts the previous step proposed (:meth:`StructuredOutputs.prepare`). A step with
no constrained slot gets None (the runner passes its placed neutral pair: nothing is built or
copied for unconstrained batches).

Order inside :meth:`jmtp.runtime.host.llm_engine.LLMEngine.step`: admission, :meth:`prepare` (it also
rewrites the scheduler's draft counts, so the bucket fits the repaired windows), the plan, the
device step, then each slot's committed tokens advance its grammar
(:meth:`~jmtp.runtime.host.structured.grammar.SequenceGrammar.commit`). The bitmask of step N+1
depends on the tokens step N committed, so it is built between the two steps, on the host; its
cost is reported (``structured_host_seconds`` in ``LLMEngine.get_stats``).
"""
from __future__ import annotations

import time

import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.device.bitmask import KEEP_DRAFT, NO_DRAFT
from jmtp.runtime.host.structured.grammar import GrammarCompiler, SequenceGrammar
from jmtp.runtime.host.structured.params import StructuredOutputsParams


class StructuredOutputs:
    """Compiles constraints and builds the per-step grammar inputs of one engine.

    Args:
      tokenizer: the engine's :class:`~jmtp.model.checkpoints.tokenizer.Tokenizer` (None: constrained
        requests are refused).
      vocab_size: the model's vocabulary. eos_token_ids: the model's EOS ids.
      window: ``K + 1``. draft_sampling: drafts carry a sampled distribution
        (``SpeculativeConfig.draft_sampling``) that rejection sampling divides by.
      verify_strategy: the engine's verification rule.
      jump_forward: propose the tokens the grammar forces as drafts.

    Attributes (counters for ``get_stats``): ``host_seconds`` (building inputs and advancing
      the grammars over committed tokens),
    ``num_constrained_steps``, ``num_forced_drafts``.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, window: int,
                 draft_sampling: bool, verify_strategy: str, jump_forward: bool = True):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.window, self.jump_forward = int(window), bool(jump_forward)
        self.draft_sampling = bool(draft_sampling)
        self.verify_strategy = verify_strategy
        self._compiler: GrammarCompiler | None = None
        self.host_seconds = 0.0
        self.num_constrained_steps = 0
        self.num_forced_drafts = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """The llguidance compiler (built at the first constrained request: ~0.2 s for a 49k
        vocabulary)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def check(self, params: StructuredOutputsParams, where: str) -> None:
        """Compile ``params`` now (cached) so an invalid constraint fails at intake.

        Raises:
          InvalidRequestError: no tokenizer, or the grammar engine rejects the constraint
            (``.field = "structured_outputs.<kind>"``).
        """
        if self.tokenizer is None:
            raise InvalidRequestError(f"{where}: structured outputs need a tokenizer (the engine "
                                      "has none)", "structured_outputs")
        try:
            self.compiler.compile(params)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{where}: {e}", e.field) from None

    def matcher(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh grammar state for one sample."""
        return self.compiler.matcher(params)

    def commit(self, grammar: SequenceGrammar, tokens) -> int:
        """Advance one sample's grammar over the tokens a step emitted; returns how many the
        grammar accepts (:meth:`SequenceGrammar.commit`; timed into :attr:`host_seconds`)."""
        t0 = time.perf_counter()
        accepted = grammar.commit(tokens)
        self.host_seconds += time.perf_counter() - t0
        return accepted

    def exact_q(self, seq) -> bool:
        """Whether ``seq``'s drafts are verified against a stored sampled distribution."""
        return (self.draft_sampling and not seq.params.greedy
                and self.verify_strategy in ("auto", "rejection"))

    def prepare(self, slots, next_drafts: np.ndarray, draft_tokens: np.ndarray | None,
                max_model_len: int):
        """The step's grammar inputs.

        Args:
          slots: the scheduler's ``list[Sequence | None]`` (``B`` slots).
          next_drafts: i32[B] drafts in each slot's pending window (rewritten in place for the
            repaired windows).
          draft_tokens: i32[B, K] the pending drafts (the last ``StepOutput.draft_tokens``), or
            None before the first step.
          max_model_len: the engine's limit (forced drafts never pass it).

        Returns:
          ``(guide, dead)``: ``guide`` = ``(token_bitmask i32[B, K+1, NW], draft_override
          i32[B, K])``, or None when no slot is constrained; ``dead`` = the slots whose grammar
          allows no token (their sample must be finished).
        """
        constrained = [(b, s) for b, s in enumerate(slots)
                       if s is not None and getattr(s, "grammar", None) is not None]
        if not constrained:
            return None, []
        t0 = time.perf_counter()
        B, W = len(slots), self.window
        masks = np.full((B, W, self.compiler.num_words), -1, np.int32)
        override = np.full((B, W - 1), KEEP_DRAFT, np.int32)
        dead = []
        for b, seq in constrained:
            g = seq.grammar
            decoding = not seq.prefilling and seq.output_ids
            n = int(next_drafts[b]) if decoding else 0
            drafts = [] if draft_tokens is None or not n else list(draft_tokens[b, :n])
            if decoding:
                seq_len = len(seq.prompt_ids) + len(seq.output_ids)
                limit = max(0, min(W - 1, seq.params.max_tokens - len(seq.output_ids) - 1,
                                   max_model_len - seq_len - 1))
            else:
                limit = 0
            before = g.num_forced
            row = g.fill_window(masks[b], drafts, limit, exact_q=self.exact_q(seq),
                                jump_forward=self.jump_forward)
            self.num_forced_drafts += g.num_forced - before
            if g.error is not None:
                dead.append(b)
                masks[b] = -1
                continue
            if decoding:
                override[b] = row
                kept = 0
                for w, v in enumerate(row):
                    if v >= 0 or (v == KEEP_DRAFT and w < n):
                        kept += 1
                    else:
                        break
                next_drafts[b] = kept
        self.num_constrained_steps += 1
        self.host_seconds += time.perf_counter() - t0
        return (masks, override), dead


__all__ = ["KEEP_DRAFT", "NO_DRAFT", "StructuredOutputs"]
