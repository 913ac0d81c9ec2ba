"""Draft proposers that need no second model: they look for the sequence's current ending
earlier in the request's own tokens (and, for `suffix`, in earlier requests' outputs) and
propose what followed it there.

Both index incrementally: each call indexes only the tokens appended since the last one, so
a proposal costs a few dictionary look-ups (microseconds), not a scan of the sequence. A
proposal is only a guess: verification keeps the output exact whatever is proposed, so a
stale index (a session that dropped a token) costs acceptance, never correctness.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class NgramProposer:
    """Prompt lookup (vLLM `ngram`): the longest n-gram, n from prompt_lookup_max down to
    prompt_lookup_min, that ends the sequence and occurred before; its latest earlier
    occurrence's continuation is the proposal."""

    __slots__ = ("n_min", "n_max", "index", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        # n-gram -> the end (exclusive) of its latest occurrence that is not the sequence's end.
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n_tok = len(tokens)
        if n_tok < self.indexed:
            self.index.clear()
            self.indexed = 0
        index = self.index
        # Index every n-gram that ends before the last position (the one ending at n_tok is
        # the pattern itself).
        for end in range(max(self.indexed, self.n_min), n_tok):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                index[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, n_tok)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            found = index.get(tuple(tokens[n_tok - n:]))
            if found is not None:
                return list(tokens[found:found + k])
        return []


class SuffixAutomaton:
    """An online suffix automaton: after each token, every substring so far is a path from
    the root; `first_end` of a state is where its first occurrence ends (exclusive)."""

    __slots__ = ("next", "link", "length", "first_end", "last", "text")

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first_end = [0]
        self.last = 0
        self.text: list[int] = []

    def extend(self, c: int) -> None:
        nxt, link, length, first_end = self.next, self.link, self.length, self.first_end
        self.text.append(c)
        cur = len(nxt)
        nxt.append({})
        length.append(length[self.last] + 1)
        link.append(0)
        first_end.append(len(self.text))
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                first_end.append(first_end[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def step(self, state: int, matched: int, c: int) -> tuple[int, int]:
        """Extend a match (state, its length) of some other text's suffix by token c."""
        nxt, link = self.next, self.link
        while state and c not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        if c in nxt[state]:
            return nxt[state][c], matched + 1
        return 0, 0


class GlobalSuffixCache:
    """The outputs of the last `max_requests` finished requests in one automaton (separated
    by distinct negative tokens, so no match crosses two). Past the bound it is rebuilt from
    the newest half; `generation` tells cursors into the old automaton to start over."""

    __slots__ = ("max_requests", "outputs", "sam", "generation", "_sep")

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.outputs: deque[list[int]] = deque()
        self.sam = SuffixAutomaton()
        self.generation = 0
        self._sep = -1

    def add(self, output: Sequence[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        self.outputs.append(list(output))
        if len(self.outputs) > self.max_requests:
            while len(self.outputs) > max(1, self.max_requests // 2):
                self.outputs.popleft()
            self.sam = SuffixAutomaton()
            self.generation += 1
            for out in self.outputs:
                self._feed(out)
        else:
            self._feed(self.outputs[-1])

    def _feed(self, output: list[int]) -> None:
        for t in output:
            self.sam.extend(t)
        self.sam.extend(self._sep)
        self._sep -= 1


class SuffixProposer:
    """vLLM `suffix` (Arctic Inference's suffix decoding), in its simplest form: the longest
    suffix of the sequence (at most max_depth tokens) found in the request's own tokens or in
    the global cache proposes what followed it, at most spec_factor drafts per matched token."""

    __slots__ = ("own", "cache", "max_depth", "spec_factor", "g_state", "g_matched",
                 "g_generation", "fed")

    def __init__(self, cache: GlobalSuffixCache | None, max_depth: int,
                 spec_factor: float) -> None:
        self.own = SuffixAutomaton()
        self.cache = cache
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.g_state = self.g_matched = self.fed = 0
        self.g_generation = cache.generation if cache is not None else 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        own, cache = self.own, self.cache
        if len(tokens) < self.fed:
            self.own = own = SuffixAutomaton()
            self.fed = self.g_state = self.g_matched = 0
        if cache is not None and cache.generation != self.g_generation:
            # The cache was rebuilt: match again from the last max_depth tokens.
            self.g_generation = cache.generation
            self.g_state = self.g_matched = 0
            for t in tokens[max(0, self.fed - self.max_depth):self.fed]:
                self.g_state, self.g_matched = cache.sam.step(self.g_state, self.g_matched, t)
        for t in tokens[self.fed:]:
            own.extend(t)
            if cache is not None:
                self.g_state, self.g_matched = cache.sam.step(self.g_state, self.g_matched, t)
        self.fed = len(tokens)
        best: list[int] = []
        # Own tokens: the longest suffix that occurred before is the suffix link of the whole.
        state = own.link[own.last]
        if state > 0:
            best = self._draft(own.text, own.first_end[state], own.length[state], k)
        if cache is not None and self.g_matched > 0:
            g = cache.sam
            draft = self._draft(g.text, g.first_end[self.g_state], self.g_matched, k)
            if len(draft) > len(best):
                best = draft
        return best

    def _draft(self, text: list[int], start: int, matched: int, k: int) -> list[int]:
        n = min(k, int(self.spec_factor * min(matched, self.max_depth)))
        out = text[start:start + n]
        for i, t in enumerate(out):
            if t < 0:  # a separator: the cached output ended there
                return out[:i]
        return out
