"""A counted suffix tree over token sequences, bounded in depth: the index of suffix decoding.

Suffix decoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging
AI Applications", arXiv 2411.04975; ArcticInference's ``SuffixTree``, which vLLM's and
FastDeploy's ``method="suffix"`` use) drafts the continuation that most often followed the
current context's last tokens in text seen before. This module is the index it needs, written
for jmtp in plain Python (the host runs it between steps; nothing here touches JAX).

**What it stores.** A set of token sequences (each under an integer id, extended one token at a
time, removable) and, for every string ``s`` of ``1 <= |s| <= D`` tokens (``D = max_depth``),
its count: the number of positions ``i`` of any stored sequence with ``seq[i:i+|s|] == s``
(``count(())`` is the number of stored tokens). It is the trie of every stored suffix cut at
depth ``D`` (a string's children are the tokens that followed it), in flat arrays indexed by
node id, with one dict from ``(node, token)`` to the child, except that a string seen once is
not spelled out: its node is a *tail* that points at its one occurrence ``(sequence, position)``,
and everything below it (count 1 as well) is read from the sequence itself. A tail becomes an
ordinary node when a second occurrence arrives (its one child then a tail at the old
occurrence's next token). So text that repeats nothing costs a node or two per token, repeated
text shares nodes, and the tree holds about one node per distinct string seen twice
(ArcticInference compresses such single-occurrence chains into multi-token edges for the same
reason). ``num_nodes`` and ``nbytes`` report the size.

**Appending** token ``t`` to a sequence extends those of its last suffixes that have been seen
elsewhere too (the *active* nodes, kept per sequence; the longer ones are single occurrences,
which the tail below them extends by itself): one dict look-up each, so the work per token
follows the length of the text the sequence currently repeats (at most ``D``), and a query for
a stored sequence's own context needs no walk.

**Drafting** (:meth:`SuffixTree.speculate`). For each match length ``m`` (the context's last
``m`` tokens, ``m <= min(len(context), D - 1)``, as long as that string was seen), from the
matched string repeatedly take the child with the highest count (ties: the smaller token id)
while fewer than ``min(max_spec_tokens, floor(m * max_spec_factor + max_spec_offset), D - m)``
tokens are drafted and the token's estimated probability ``count(s + d_1..d_j) / count(s)``
(the product of the parent-to-child count ratios along the path) is at least
``min_token_prob``; a draft's score is the sum of its tokens' probabilities (the expected number
of them to be accepted, if the counts were the truth). The draft with the highest score wins, a
longer match on ties. A longer match drafts more (the speculation length follows the match
length) and a rarer continuation fewer (it follows the frequency): where nothing repeats, the
draft is empty and the step verifies no draft. The search runs from the longest match down and
stops at a match whose length limit (an upper bound of its score) cannot beat the best.

Tested against a naive scan of the stored sequences (``tests/runtime/test_suffix_tree.py``).
"""
from __future__ import annotations

import dataclasses
import sys
from array import array

__all__ = ["SuffixDraft", "SuffixTree", "EMPTY_DRAFT"]

_SHIFT = 32          # edge key: node << 32 | token (token ids below 2**32)


@dataclasses.dataclass(frozen=True)
class SuffixDraft:
    """One speculation.

    Attributes:
      token_ids: the drafted tokens, in order.
      probs: each token's estimated probability (non-increasing), as many as ``token_ids``.
      score: ``sum(probs)``, the expected number of accepted tokens the counts predict.
      match_len: the number of context tokens matched (0 for an empty draft).
    """

    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


EMPTY_DRAFT = SuffixDraft()


class SuffixTree:
    """The depth-bounded counted suffix tree of the module docstring.

    Args:
      max_depth: ``D >= 2``, the longest string counted (vLLM's
        ``suffix_decoding_max_tree_depth``): a match plus its draft spans at most ``D`` tokens.

    A *position* in the tree (what :meth:`match_nodes` returns per match length) is a node id
    (int) or, inside the single-occurrence chain below a tail, ``(sequence id, index of the
    string's last token)``.

    Raises:
      ValueError: ``max_depth < 2``. KeyError: removing an unknown sequence.
    """

    def __init__(self, max_depth: int):
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an int >= 2, got {max_depth!r}")
        self.max_depth = max_depth
        self._edge: dict[int, int] = {}     # node << 32 | token -> child node
        # per node (id = index; node 0 is the root, the empty string):
        self._count = array("q", [0])       # occurrences of the node's string
        self._best = array("q", [-1])       # its most frequent child (ties: smaller token); -1
        self._token = array("q", [-1])      # the last token of its string
        self._ref = array("q", [-1])        # a tail's sequence id (-1: an ordinary node)
        self._pos = array("q", [-1])        # a tail's index of its string's last token
        self._first = array("q", [-1])      # first child, then siblings in a doubly linked list
        self._next = array("q", [-1])
        self._prev = array("q", [-1])
        self._free: list[int] = []          # recycled node ids
        self._seqs: dict[int, list[int]] = {}
        # per sequence: the ordinary nodes of its last l tokens, l = 0, 1, ... (index = l);
        # its longer suffixes occur only there (below a tail)
        self._active: dict[int, list[int]] = {}
        self.num_tokens = 0

    # ------------------------------------------------------------------ size
    @property
    def num_nodes(self) -> int:
        """Nodes in use (ordinary and tails), the root included."""
        return len(self._count) - len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def nbytes(self) -> int:
        """Host bytes held (an estimate): the per-node arrays, the edge dict with its key and
        value objects (about 32 + 28 bytes each) and the stored token lists."""
        arrays = sum(a.itemsize * len(a) for a in (
            self._count, self._best, self._token, self._ref, self._pos,
            self._first, self._next, self._prev))
        seqs = sum(sys.getsizeof(s) for s in self._seqs.values())
        return arrays + sys.getsizeof(self._edge) + 60 * len(self._edge) + seqs

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens stored under ``seq_id`` (the list itself; do not modify)."""
        return self._seqs[seq_id]

    # ------------------------------------------------------------------ updates
    def _new_node(self, parent: int, token: int, ref: int, pos: int) -> int:
        if self._free:
            n = self._free.pop()
            self._count[n], self._best[n], self._token[n] = 1, -1, token
            self._ref[n], self._pos[n] = ref, pos
            self._first[n], self._prev[n] = -1, -1
        else:
            n = len(self._count)
            for a, v in ((self._count, 1), (self._best, -1), (self._token, token),
                         (self._ref, ref), (self._pos, pos),
                         (self._first, -1), (self._prev, -1), (self._next, -1)):
                a.append(v)
        head = self._first[parent]
        self._next[n] = head
        if head >= 0:
            self._prev[head] = n
        self._first[parent] = n
        self._edge[(parent << _SHIFT) | token] = n
        return n

    def _better(self, node: int, c: int) -> None:
        """``node``'s child ``c`` gained a count: it may be the most frequent now."""
        b = self._best[node]
        if b != c and (b < 0 or self._count[c] > self._count[b]
                       or (self._count[c] == self._count[b] and self._token[c] < self._token[b])):
            self._best[node] = c

    def extend(self, seq_id: int, tokens) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new sequence if unknown)."""
        if seq_id not in self._seqs:
            self._seqs[seq_id] = []
            self._active[seq_id] = [0]
        seq = self._seqs[seq_id]
        edge, count, ref, pos = self._edge, self._count, self._ref, self._pos
        D = self.max_depth
        for t in tokens:
            t = int(t)
            n = len(seq)
            seq.append(t)
            count[0] += 1
            act = self._active[seq_id]
            new, spelled = [0], True
            for l, node in enumerate(act):          # the string act[l] + t, of l + 1 tokens
                c = edge.get((node << _SHIFT) | t)
                if c is None:                       # first seen: a tail at this occurrence
                    c = self._new_node(node, t, seq_id, n)
                    spelled = False                 # (and so are all longer ones)
                elif ref[c] >= 0:                   # seen once: a second occurrence
                    other, at = ref[c], pos[c]
                    oseq = self._seqs[other]
                    ref[c], count[c] = -1, 2
                    if l + 2 <= D and at + 1 < len(oseq):    # the old occurrence goes on
                        self._best[c] = self._new_node(c, oseq[at + 1], other, at + 1)
                    elif at == len(oseq) - 1 and other != seq_id and l + 1 < D:
                        self._active[other].append(c)   # it ends that sequence: extend it too
                else:
                    count[c] += 1
                if node:   # the root's best child is never read (matches have m >= 1)
                    self._better(node, c)
                if spelled:
                    new.append(c)
            if len(new) > D:     # the suffix of length D cannot be extended
                new.pop()
            self._active[seq_id] = new
        self.num_tokens += len(tokens)

    def _rescan(self, node: int) -> None:
        """Recompute ``node``'s most frequent child from its children."""
        count, tok = self._count, self._token
        best, c = -1, self._first[node]
        while c >= 0:
            if best < 0 or count[c] > count[best] or (count[c] == count[best]
                                                      and tok[c] < tok[best]):
                best = c
            c = self._next[c]
        self._best[node] = best

    def _unlink(self, parent: int, c: int) -> None:
        p, n = self._prev[c], self._next[c]
        if p >= 0:
            self._next[p] = n
        else:
            self._first[parent] = n
        if n >= 0:
            self._prev[n] = p
        del self._edge[(parent << _SHIFT) | self._token[c]]
        self._free.append(c)

    def remove(self, seq_id: int) -> None:
        """Forget sequence ``seq_id``: every count it added is taken back, nodes left with a
        count of 0 are freed (an ordinary node left with a count of 1 stays one). Costs up to
        ``len * D`` steps.

        Raises:
          KeyError: unknown ``seq_id``.
        """
        seq = self._seqs.pop(seq_id)
        del self._active[seq_id]
        edge, count, best, ref = self._edge, self._count, self._best, self._ref
        D = self.max_depth
        for i in range(len(seq)):
            count[0] -= 1
            path, node = [], 0
            for t in seq[i:i + D]:
                c = edge[(node << _SHIFT) | t]
                count[c] -= 1
                path.append((node, c))
                if ref[c] >= 0:          # this occurrence's own tail: nothing below it
                    break
                node = c
            for parent, c in reversed(path):       # children first: a freed node is a leaf
                if count[c] == 0:
                    self._unlink(parent, c)
                    if parent and best[parent] == c:
                        self._rescan(parent)
                elif parent and best[parent] == c:
                    self._rescan(parent)
        self.num_tokens -= len(seq)

    # ------------------------------------------------------------------ queries
    def _locate(self, tokens):
        """The position of the string ``tokens`` (``1 <= len <= D``), or None if never seen."""
        node, edge, ref = 0, self._edge, self._ref
        for j, t in enumerate(tokens):
            c = edge.get((node << _SHIFT) | int(t), -1)
            if c < 0:
                return None
            if ref[c] >= 0:              # a tail: the rest must follow its one occurrence
                seq, at, rest = self._seqs[ref[c]], self._pos[c], len(tokens) - j - 1
                if seq[at + 1:at + 1 + rest] != [int(x) for x in tokens[j + 1:]]:
                    return None
                return (ref[c], at + rest) if rest else c
            node = c
        return node

    def count(self, tokens) -> int:
        """Occurrences of the string ``tokens`` (``len <= D``) in the stored sequences."""
        if not len(tokens):
            return self._count[0]
        p = self._locate(tokens)
        return 0 if p is None else (1 if isinstance(p, tuple) else self._count[p])

    def children(self, tokens) -> dict[int, int]:
        """``{token: count of tokens + (token,)}`` for every token that followed ``tokens``
        (``len < D``)."""
        p = self._locate(tokens) if len(tokens) else 0
        if p is None or len(tokens) >= self.max_depth:
            return {}
        if isinstance(p, int) and self._ref[p] < 0:
            out, c = {}, self._first[p]
            while c >= 0:
                out[self._token[c]] = self._count[c]
                c = self._next[c]
            return out
        seq, at = ((self._seqs[p[0]], p[1]) if isinstance(p, tuple)
                   else (self._seqs[self._ref[p]], self._pos[p]))
        return {seq[at + 1]: 1} if at + 1 < len(seq) else {}

    def match_nodes(self, context, known: list[int] | None = None,
                    own: int = 0) -> list:
        """Positions of the context's last ``m`` tokens for ``m = 1, 2, ...`` up to
        ``min(len(context), D - 1)``, stopping before the first string never seen.

        ``known``: :meth:`active_nodes` of a stored sequence whose ``own`` tokens end the
        context (a running request's output): they are the positions for ``m <= len(known)``,
        and if they stop short of ``min(own, D - 1)``, the longer strings occur only at that
        sequence's end (nothing follows them), so none is looked up.
        """
        D = self.max_depth
        ctx = list(context[-(D - 1):]) if len(context) >= D else list(context)
        n = len(ctx)
        out = list(known[:n]) if known else []
        if known is not None and len(out) < min(own, n):
            return out
        for m in range(len(out) + 1, n + 1):
            p = self._locate(ctx[n - m:])
            if p is None:
                break
            out.append(p)
        return out

    def active_nodes(self, seq_id: int) -> list[int]:
        """The ordinary nodes of sequence ``seq_id``'s own last ``m`` tokens, ``m = 1, ...``
        (its longer suffixes occur only at its end: nothing follows them)."""
        return self._active[seq_id][1:]

    def speculate(self, context=None, max_spec_tokens: int = 8, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  nodes: list | None = None) -> SuffixDraft:
        """The best path draft after ``context`` (module docstring; ``nodes`` as
        :meth:`match_nodes` returns them may replace ``context``).

        Returns:
          a :class:`SuffixDraft` (:data:`EMPTY_DRAFT` when nothing continues the context).
        """
        if nodes is None:
            nodes = self.match_nodes(context)
        count, best_child, tok, ref, pos = (self._count, self._best, self._token, self._ref,
                                            self._pos)
        D = self.max_depth
        best = EMPTY_DRAFT
        # longest match first, so that a shorter one must score strictly more (ties go to the
        # longer match); a match whose length limit cannot beat the best ends the search (the
        # limit, an upper bound of the score, does not grow as the match shortens)
        for m in range(len(nodes), 0, -1):
            p = nodes[m - 1]
            limit = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6),
                        D - m)
            if limit <= best.score:
                break
            tokens, probs, score = [], [], 0.0
            if isinstance(p, tuple) or ref[p] >= 0:    # one occurrence: what follows it
                seq, at = (self._seqs[p[0]], p[1]) if isinstance(p, tuple) else (
                    self._seqs[ref[p]], pos[p])
                tokens = seq[at + 1:at + 1 + limit]     # probability 1 each
                probs = [1.0] * len(tokens)
                score = float(len(tokens))
            else:
                base, n = count[p], p
                while len(tokens) < limit:
                    c = best_child[n]
                    if c < 0:
                        break
                    prob = count[c] / base   # the product of the count ratios along the path
                    if prob < min_token_prob:
                        break
                    tokens.append(tok[c])
                    probs.append(prob)
                    score += prob
                    if ref[c] >= 0:          # a tail: its occurrence goes on, count 1
                        seq, at = self._seqs[ref[c]], pos[c]
                        more = seq[at + 1:at + 1 + limit - len(tokens)]
                        tokens += more
                        probs += [prob] * len(more)
                        score += prob * len(more)
                        break
                    n = c
            if tokens and score > best.score:
                best = SuffixDraft(tuple(tokens), tuple(probs), score, m)
        return best
