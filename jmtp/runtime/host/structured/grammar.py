"""Grammar state on the host: compiling constraints and the token bitmask of every window row.

The grammar engine is llguidance (Microsoft's Rust Earley/derivative-regex engine; PyPI
``llguidance``): JSON schema, regex and Lark grammars, token bitmasks into NumPy memory,
cheap copies of a parser state and forced ("fast-forward") tokens, with no torch dependency.
Measured against xgrammar 0.2.9 on SmolLM2's tokenizer (``scripts/bench_grammar_engines.py``,
docs/structured_outputs.md): xgrammar fills one mask faster (6 µs vs 47 µs mean) but needs torch
and triton installed, compiles a schema slower (8.4 ms vs 4.6 ms with the matcher) and has no
token-level forced-token call; a mask costs well under 1 % of a step either way.

:class:`GrammarCompiler` holds the llguidance tokenizer of one engine and compiles each
:class:`~jmtp.runtime.host.structured.params.StructuredOutputsParams` once (an LRU cache), raising
:class:`~jmtp.core.errors.InvalidRequestError` for a grammar llguidance rejects.
:class:`SequenceGrammar` is one sample's matcher. Its :meth:`~SequenceGrammar.fill_window` is the
per-draft-position masking of a verify window: a copy of the matcher (llguidance's
``deep_copy``, ~2 µs) is advanced over the window's drafts (repaired: see below) and one bitmask
row is written per position; the sample's own matcher stays at the committed prefix (a copy, not
``rollback``: a draft that leads into a dead end leaves an llguidance matcher in a sticky error
state that rolling back does not clear). :meth:`~SequenceGrammar.commit` then advances it over the
tokens the step actually committed, so after a rejection in the middle of a window the state
equals that of feeding the accepted tokens only (``tests/runtime/test_structured.py`` checks it,
property-based).

Draft repair (what the window verifies), keeping verification lossless:

* where the grammar forces the next tokens (llguidance's ``compute_ff_tokens``: fixed keys,
  punctuation, closing brackets) the window's draft is the forced token, with a one-hot draft
  distribution. The choice is a function of the prefix alone, so it is a valid proposal for
  rejection sampling; where the mask allows that token only, it is accepted by construction.
  Forced tokens also extend a window past the proposer's drafts, up to ``limit``;
* where the proposer's draft breaks the grammar, a greedy slot (or one whose drafts carry no
  distribution) cuts the window there: the target row samples the masked distribution, which is
  what rejecting a one-hot draft does. A slot with sampled drafts (``exact_q``) keeps the draft:
  cutting only invalid samples would change the proposal distribution the acceptance rule
  divides by, so the verifier rejects it instead.
"""
from __future__ import annotations

import functools
import json

import numpy as np

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.device.bitmask import KEEP_DRAFT, NO_DRAFT, bitmask_words
from jmtp.runtime.host.structured.params import StructuredOutputsParams

def allowed(row: np.ndarray, token: int) -> bool:
    """Whether bitmask ``row`` (``i32[NW]``) allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer and model vocabulary.

    Args:
      tokenizer: a :class:`~jmtp.model.checkpoints.tokenizer.Tokenizer` (its ``backend`` is a Hugging Face
        ``tokenizers.Tokenizer``; llguidance reads its JSON).
      vocab_size: the model's vocabulary ``V`` (bitmask rows cover ``V`` ids; ids the tokenizer
        cannot produce are never allowed).
      eos_token_ids: the ids that end a constrained output where the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import llguidance
        self._llg = llguidance
        self.vocab_size = int(vocab_size)
        self.num_words = bitmask_words(self.vocab_size)
        eos = [int(t) for t in eos_token_ids]
        self.eos_token_ids = frozenset(eos)
        if not eos:
            raise ValueError("structured outputs need an EOS token id (the model config has none)")
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                                n_vocab=self.vocab_size, eos_token=eos)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def _compile_uncached(self, key: str):
        """``(grammar text, a fresh matcher to copy)`` of a constraint's key."""
        params = StructuredOutputsParams(**json.loads(key))
        try:
            grammar = params.grammar_source()
        except InvalidRequestError:
            raise
        except ValueError as e:     # llguidance's converters refuse the constraint
            raise InvalidRequestError(
                f"StructuredOutputsParams.{params.kind}: the grammar engine rejects it: {e}",
                f"structured_outputs.{params.kind}") from None
        bad, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if bad:
            raise InvalidRequestError(
                f"StructuredOutputsParams.{params.kind}: the grammar engine rejects it: "
                f"{messages[0] if messages else 'invalid'}", f"structured_outputs.{params.kind}")
        proto = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise InvalidRequestError(f"StructuredOutputsParams.{params.kind}: "
                                      f"{proto.get_error()}", f"structured_outputs.{params.kind}")
        return grammar, proto

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked llguidance grammar of ``params`` (cached by value).

        Raises:
          InvalidRequestError: ``.field = "structured_outputs.<kind>"``, with llguidance's message.
        """
        return self._compile(json.dumps(params.to_dict()))[0]   # key order matters (properties)

    def matcher(self, params: StructuredOutputsParams) -> "SequenceGrammar":
        """A fresh :class:`SequenceGrammar` for one sample."""
        # compiled once per constraint (cached with its text); each sample gets a copy (~2 µs)
        _, proto = self._compile(json.dumps(params.to_dict()))
        return SequenceGrammar(proto.deep_copy(), self.num_words, self.eos_token_ids)


class SequenceGrammar:
    """One sample's grammar state (an llguidance ``LLMatcher`` over its committed tokens).

    Attributes:
      error: None, or why the constraint cannot continue (no token is allowed, or a committed
        token broke it); the engine then finishes the sample with ``finish_reason="abort"``.
    """

    def __init__(self, matcher, num_words: int, eos_token_ids=frozenset()):
        self.matcher = matcher
        self.num_words = num_words
        self.eos_token_ids = frozenset(eos_token_ids)
        self.error: str | None = None
        self.num_forced = 0     # drafts the grammar forced, over the sample's life
        self.banned: tuple[int, ...] = ()   # ids the request bans everywhere (set by the engine)
        # the last fill_window's (rows i32[W, NW], window tokens, rows filled), for commit
        self._window: tuple = (None, [], 0)

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the bitmask of the next token (``i32[NW]``, C-contiguous) into ``row``."""
        self.fill_mask_of(self.matcher, row)

    def commit(self, tokens) -> int:
        """Advance over tokens a step emitted (EOS included; a resumed request's re-emitted
        token is not passed here) and return how many of them, from the first, the constraint
        allows: all of them, unless one is outside it, which sets :attr:`error` (the engine then
        emits only the allowed ones and ends the sample with ``finish_reason="abort"``).

        A token is checked against the bitmask the step used for its position (the rows of the
        last :meth:`fill_window`, while the emitted tokens follow its window; else the mask of
        the matcher's state), not by ``consume_token`` alone: llguidance's matcher consumes
        some tokens its mask excludes (a non-canonical split such as ``{`` where ``{"`` is one
        token, or EOS before the constraint is complete). After a complete constraint only EOS
        is allowed (rows emitted past an EOS with ``ignore_eos``). Masked sampling never emits
        such a token: this is the engine's check of that invariant."""
        masks, window, filled = self._window
        self._window = (None, [], 0)
        row = np.empty((self.num_words,), np.int32)
        tokens = [int(t) for t in tokens]
        for i, t in enumerate(tokens):
            if self.error is not None:
                return i
            if self.matcher.is_stopped():
                if t not in self.eos_token_ids:
                    self.error = f"token {t} after the constraint was complete (only EOS is)"
                    return i
                continue
            if i < filled and tokens[:i] == window[:i]:
                mask = masks[i]                  # the row the step masked this position with
            else:
                self.fill_mask(row)
                self._ban(row)
                mask = row
            if not (0 <= t < 32 * self.num_words and allowed(mask, t)):
                self.error = f"token {t} is outside the constraint (not in its bitmask)"
                return i
            if not self.matcher.consume_token(t) or self.matcher.is_error():
                reason = (self.matcher.get_error() or "refused").strip().splitlines()[0]
                self.error = f"token {t} is outside the constraint ({reason})"
                return i
        return len(tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS)."""
        return self.matcher.is_stopped()

    def fill_window(self, masks: np.ndarray, drafts, limit: int, *, exact_q: bool,
                    jump_forward: bool = True) -> list[int]:
        """Bitmask rows of one verify window, and its repaired drafts.

        Args:
          masks: i32[W, NW] (C-contiguous) written in place: row ``w`` is the mask after the
            committed tokens and the first ``w`` (repaired) drafts; rows past the last draft the
            grammar accepted are all ones (never emitted from).
          drafts: the proposer's drafts for the window (``d_1..d_n``, ids ``>= 0``).
          limit: most drafts the window may hold (``<= W - 1``; the request's remaining tokens).
          exact_q: the slot's drafts were sampled from a stored distribution (rejection sampling
            divides by it): a draft is replaced only where the grammar forces the token, and an
            invalid one is kept for the verifier to reject (module docstring).
          jump_forward: propose forced tokens.

        Returns:
          ``i32[W-1]`` draft override row: :data:`KEEP_DRAFT` where the proposer's draft stands,
          a token id where the draft is forced or extended, :data:`NO_DRAFT` from where the
          window is cut. Sets :attr:`error` when row 0 allows no token.
        """
        W = masks.shape[0]
        override = np.full((W - 1,), NO_DRAFT, np.int32)
        masks[:] = -1
        self._window = (None, [], 0)
        if self.error is not None:     # (the first reason stands; the engine ends the sample)
            return override
        window: list[int] = []
        self._window = (masks, window, W)   # rows not filled below stay all ones (never used)
        # The window is explored on a copy (2 µs): a draft that leads into a dead end puts an
        # llguidance matcher into a sticky error state that rolling back does not clear.
        m = self.matcher.deep_copy()
        drafts = [int(d) for d in drafts]
        queue: list[int] = []    # forced tokens still ahead (llguidance gives them all at once)
        token = None
        for w in range(W):
            if token in self.eos_token_ids:
                # the window ends at an EOS draft; the rows after it (used only with ignore_eos)
                # allow EOS alone, as a complete constraint does
                masks[w:] = 0
                for t in self.eos_token_ids:
                    if t >> 5 < masks.shape[1]:
                        masks.view(np.uint32)[w:, t >> 5] |= np.uint32(1 << (t & 31))
                break
            row = masks[w]
            self.fill_mask_of(m, row)
            self._ban(row)
            if m.is_error() or not row.any():
                if w == 0:
                    self.error = (f"no token is allowed here: the grammar reached a dead end "
                                  f"({m.stop_reason()})")
                    masks[0] = -1
                    return override
                # the previous draft leads nowhere: forbid it and end the window there. A forced
                # token is cut (its choice depended on the prefix only); a sampled draft of the
                # proposer stays for the verifier to reject (its row now forbids it)
                _forbid(masks, w - 1, token)
                masks[w] = -1
                window.pop()     # (commit then checks a token there against the matcher)
                override[w - 1] = (KEEP_DRAFT if exact_q and override[w - 1] == KEEP_DRAFT
                                   else NO_DRAFT)
                break
            if w >= limit:
                break
            proposed = drafts[w] if w < len(drafts) else None
            valid = proposed is not None and allowed(row, proposed)
            # a sampled draft is replaced only on a rule that ignores its value (lossless)
            if jump_forward and not queue and (exact_q or not valid):
                queue = list(m.compute_ff_tokens())
                if not queue and int(np.bitwise_count(row.view(np.uint32)).sum()) == 1:
                    queue = [int(np.flatnonzero(unpack_row(row, len(row) * 32))[0])]
            if queue and (not allowed(row, queue[0]) or (valid and not exact_q
                                                         and queue[0] != proposed)):
                queue = []      # (a greedy slot prefers its valid draft)
            if queue:
                token = queue.pop(0)
                override[w] = token if (exact_q or token != proposed) else KEEP_DRAFT
                self.num_forced += 1
            elif valid:
                token = proposed
                override[w] = KEEP_DRAFT
            else:
                if proposed is not None and exact_q:   # the verifier rejects it
                    override[w:len(drafts)] = KEEP_DRAFT
                break
            if not m.consume_token(token):   # cannot happen for an allowed token
                _forbid(masks, w, token)
                override[w] = (KEEP_DRAFT if exact_q and override[w] == KEEP_DRAFT
                               else NO_DRAFT)
                break
            window.append(token)
        return override

    @staticmethod
    def fill_mask_of(matcher, row: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def _ban(self, row: np.ndarray) -> None:
        """Clear the request's banned tokens (``bad_token_ids``, one-token bad words) in ``row``,
        so a constraint they leave without any token is a dead end found on the host."""
        for t in self.banned:
            if t >> 5 < row.shape[0]:
                row.view(np.uint32)[t >> 5] &= ~np.uint32(1 << (t & 31))


def _forbid(masks: np.ndarray, w: int, token: int) -> None:
    """Clear ``token``'s bit in row ``w`` of ``masks`` (i32[W, NW])."""
    masks.view(np.uint32)[w, token >> 5] &= ~np.uint32(1 << (token & 31))


def unpack_row(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """``bool[vocab_size]`` of a bitmask row ``i32[NW]`` (little-endian bits)."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
