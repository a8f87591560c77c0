"""Prefix sharing: a prompt's whole pages prefilled once and kept, so that every request extending
it prefills only the rest (`Server(prefix_cache=True)`: every family, modes resident, hisparse, noio, hybrid).

A `PrefixIndex` remembers which token prefixes, in pages of `PAGE_TOKENS` tokens, whose rows are kept,
as one of two stores:
- shared host pages (mode hisparse, every family: `runtime.shares_prefixes`): the host pool is counted
  pages behind a page table (`HierarchicalKVCache(page_rows=...)`: a page holds 64 tokens of a stream,
  DSA 64 rows of a token, Quest 4 units of 16, NSA 1 block of 64); a cached prefix's rows stay on its
  pages, which the request's streams open on (each gains a holder and stays read-only while shared;
  the lane prefill leaves those units unwritten) and from which `runtime.shared_rows` reads them back;
  the index keeps only the rest of the family's prefilled rows as host copies: what lives on the GPU
  (DSA's indexer keys, Quest's dense layers, NSA's compressed blocks; Quest's page bounds and NSA's
  window are remade from the keys by the adoption) - `runtime.shared_page_parts` are what the pages hold;
- host copies (modes resident, noio, hybrid): the index keeps the family's whole prefilled rows of the
  prefix as host copies (`CopyPages`: page ids counted against a byte budget, `memory.copy_budget`:
  a quarter of the host budget, `COPY_SHARE`, beside noio's and hybrid's pool). Hybrid places a request
  resident or hierarchical only at its admission, so a copy that the adoption places is the one way
  that is the same for both placements.

Either way a prefix `Handoff` of the prefix's length carries the rows (pinned host copies, `to_host`)
and `LanePrefill.adopt` places them as the request's own prefill would have (the lane, the workspace,
the host pool, hybrid's runs), and the prefill goes on from there, with the same chunk boundaries:
- admission (`take`): the longest cached prefix of the prompt, in whole pages and leaving at least one
  token to prefill; the rows are concatenated along `runtime.row_token_dims` (NSA's compressed blocks:
  those complete within the prefix, `runtime.prefix_rows`; one that straddles its end is the rest's);
- the join (`insert`): the prompt's whole pages, those not cached yet, go into the index, their rows
  read from the prefill's own state (`runtime.prefilled_rows`);
- room: shared pages: an admission that does not fit evicts the least recently used prefixes that only
  the index holds (a running request's streams hold their own references), its own prefix locked
  meanwhile; copies: an insertion that would pass the budget evicts them first, else keeps fewer pages.
  No lock outlives the call; `index.clear()` gives every page and copy back.
"""
from __future__ import annotations

import itertools
import math

import torch

from hisparse.serving.handoff import Handoff, to_host
from hisparse.serving.prefix import Payload, PrefixIndex

PAGE_TOKENS = 64          # tokens a page of the index holds (a host page of a stream: DSA 64 rows, Quest 4, NSA 1)


class PoolPages:
    """The index's page allocator for shared host pages: a page-table cache's counted host pages."""

    page_size = PAGE_TOKENS          # tokens: a host page of each stream (cache.page_rows units)

    def __init__(self, cache):
        self.cache = cache

    def incref(self, pages) -> None:
        self.cache.share_pages(list(pages))

    def decref(self, pages) -> None:
        self.cache.release_pages(list(pages))


class CopyPages:
    """The index's page allocator for host copies: an id per page of tokens (the index's one stream),
    each with the bytes of its copies, counted in `used` while the index holds it, against `budget`."""

    page_size = PAGE_TOKENS

    def __init__(self, budget: int):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget = {budget!r}: expected the bytes the copies may take, an integer >= 0")
        self.budget, self.used = budget, 0
        self.bytes: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self._ids = itertools.count()

    @property
    def free(self) -> int:
        return self.budget - self.used

    def new(self, page_bytes: list[int]) -> list[int]:
        """Ids for pages of these bytes, counted once the index takes them (`incref`)."""
        ids = [next(self._ids) for _ in page_bytes]
        self.bytes.update(zip(ids, page_bytes))
        return ids

    def incref(self, pages) -> None:
        for p in pages:
            self.count[p] = self.count.get(p, 0) + 1
            self.used += self.bytes[p] if self.count[p] == 1 else 0

    def decref(self, pages) -> None:
        for p in pages:
            if self.count.get(p, 0) < 1:
                raise ValueError(f"decref of page {p}, which no one holds")
            self.count[p] -= 1
            if not self.count[p]:
                self.used -= self.bytes.pop(p)
                del self.count[p]


class PrefixSharing:
    """A server's prefix index and what it did: tokens asked for, tokens found cached, prompt tokens
    prefilled (`stats`); host copies take at most `memory.copy_budget` bytes."""

    def __init__(self, memory, prefill_chunk: int | None = None):
        self.cache, self.runtime = memory.cache, memory.runtime
        # a hit's length: whole pages, and where the family's prefill depends on its chunk boundaries
        # (NSA), whole chunks too, so the rest starts where a prefill from token 0 would start a chunk
        chunked = prefill_chunk and memory.runtime.prefill_depends_on_chunks
        self.align = math.lcm(PAGE_TOKENS, prefill_chunk) if chunked else PAGE_TOKENS
        self.paged = memory.page_rows is not None
        if self.paged:
            self.allocator = PoolPages(memory.cache)
            self.index = PrefixIndex(self.allocator, memory.streams_per_request)
        else:
            self.allocator = CopyPages(memory.copy_budget)
            self.index = PrefixIndex(self.allocator, 1)
        self.prompt_tokens = self.hit_tokens = 0
        self._extras_bytes = (-1, 0)                 # (index.changes, bytes) of `host_bytes`

    def _cacheable(self, prompt: torch.Tensor) -> list[int]:
        return prompt[:len(prompt) - 1].tolist()            # one token at least is prefilled

    def _peek(self, tokens: list[int]) -> int:
        """The cached prefix of `tokens` a request may take: the longest, cut to whole `align` tokens."""
        length = self.index.peek(tokens)
        return length - length % self.align

    def _match(self, tokens: list[int]):
        """(length, handle) of the prefix `_peek` gives (a node split there if need be)."""
        return self.index.match(tokens[:self._peek(tokens)])

    def admissible(self, regions: list[int], prompt: torch.Tensor) -> bool:
        """Shared pages: whether streams of these capacities fit now, the cached prefix of `prompt`
        shared; if not, and if the pages only the index holds could make the room, cached prefixes are
        evicted, least recently used first (never this prompt's own: locked meanwhile), as far as the
        pages missing, and it is asked again. (Host copies take no room of the pool: `cache.fits`.)"""
        if not self.paged:
            return self.cache is None or self.cache.fits(regions)
        tokens = self._cacheable(prompt)
        length = self._peek(tokens)
        if self.cache.fits(regions, [length // PAGE_TOKENS] * len(regions)):
            return True
        host = self.cache.host
        missing = sum(host.pages_for(r) for r in regions) - len(regions) * (length // PAGE_TOKENS) - \
            host.free_rows // host.page_rows
        _, handle = self._match(tokens)
        self.index.lock(handle)
        try:               # evict only where that makes the room: pages only the index holds, unlocked
            freeable = sum(host.refcount(p) == 1 for stream in self.index.unlocked_pages() for p in stream)
            if freeable < missing:
                return False
            held = lambda pages: any(host.refcount(p) > 1 for stream in pages for p in stream)  # noqa: E731
            self.index.evict(max(missing, 1), keep=held)
        finally:
            self.index.unlock(handle)
        return self.cache.fits(regions, [self._peek(tokens) // PAGE_TOKENS] * len(regions))

    def take(self, prompt: torch.Tensor) -> tuple[list[list[int]] | None, Handoff] | None:
        """The prompt's cached prefix now: (its pages per stream, shared pages only, else None; its
        handoff), or None when none is."""
        length, handle = self._match(self._cacheable(prompt))
        if not length:
            return None
        pieces = [node.layers for node in handle.extras()]              # per node: per layer, its parts
        dims = self.runtime.row_token_dims
        rows = [tuple(None if pieces[0][layer][j] is None else torch.cat([p[layer][j] for p in pieces], dims[j])
                      for j in range(len(dims))) for layer in range(len(pieces[0]))]
        if not self.paged:
            return None, Handoff(length, rows, None, tokens=prompt[:length].clone())
        pages = handle.pages()
        for layer, parts in self.runtime.shared_rows(self.cache, pages).items():    # what the pages hold
            rows[layer] = tuple(part if part is not None else kept for part, kept in zip(parts, rows[layer]))
        return pages, Handoff(length, rows, None, tokens=prompt[:length].clone())

    def insert(self, prompt: torch.Tensor, state, streams: list[int]) -> None:
        """A joined request's whole prompt pages into the index (those not cached yet): host copies of
        its prefilled rows read from its prefill's `state` (less what its host pages hold, shared pages:
        its `streams`' pages). Copies: as many pages as the budget holds, least recently used evicted."""
        prefilled = self.runtime.prefilled_rows([state])
        layers = [prefilled(0, i) for i in range(len(state.layers))]
        tokens = prompt.tolist()
        if not self.paged:
            tokens = tokens[:self._room(tokens, layers) * PAGE_TOKENS]
        paged = [self.runtime.shared_page_parts(i) if self.paged else () for i in range(len(layers))]

        def payload(first: int, last: int) -> Payload:
            start, end = first * PAGE_TOKENS, last * PAGE_TOKENS
            parts = [tuple(None if t is None or j in paged[i] else to_host(t)
                           for j, t in enumerate(self.runtime.prefix_rows(rows, start, end)))
                     for i, rows in enumerate(layers)]
            extras = _PageRows(self.runtime, parts, start, last - first)
            if self.paged:
                return Payload([self.cache.stream_pages(s)[first:last] for s in streams], extras)
            return Payload([self.allocator.new([self._page_bytes(layers, p) for p in range(first, last)])], extras)
        self.index.insert(tokens, payload)

    def _page_bytes(self, layers: list[tuple], page: int) -> int:
        """Bytes of the copies of page `page`'s rows (every layer's parts)."""
        start = page * PAGE_TOKENS
        return sum(t.nbytes for rows in layers for t in self.runtime.prefix_rows(rows, start, start + PAGE_TOKENS)
                   if t is not None)

    def _room(self, tokens: list[int], layers: list[tuple]) -> int:
        """Host copies: the whole pages of `tokens` the index may hold, its cached ones and as many new
        ones as the budget holds once the least recently used other prefixes are evicted for them."""
        length, handle = self.index.match(tokens)
        pages, taken = length // PAGE_TOKENS, 0
        self.index.lock(handle)
        try:
            for page in range(pages, len(tokens) // PAGE_TOKENS):
                need = self._page_bytes(layers, page)
                while taken + need > self.allocator.free and self.index.evict(1):
                    pass
                if taken + need > self.allocator.free:
                    break
                pages, taken = page + 1, taken + need
        finally:
            self.index.unlock(handle)
        return pages

    def host_bytes(self) -> int:
        """Host bytes of what the index keeps beside the pool's pages: its copies (`CopyPages`), or
        with shared pages the GPU-resident parts' copies (`_PageRows`)."""
        if not self.paged:
            return self.allocator.used
        if self._extras_bytes[0] != self.index.changes:      # (asked every iteration: summed where it changed)
            self._extras_bytes = (self.index.changes, sum(t.nbytes for extras in self.index.all_extras()
                                                          if extras is not None for rows in extras.layers
                                                          for t in rows if t is not None))
        return self._extras_bytes[1]

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        """An admission done (its prefill started): its prompt's tokens and those it found cached."""
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def stats(self) -> dict[str, float]:
        """Prompt tokens admitted and found cached (since the last `run_stats`), the prompt tokens
        prefilled, and the pages the index holds (shared pages: a page a stream; copies: a page of
        tokens over every layer)."""
        return {"prefix_prompt_tokens": self.prompt_tokens, "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prefill_tokens": self.prompt_tokens - self.hit_tokens,
                "prefix_cached_pages": self.index.stats()["cached_pages"]}

    def run_stats(self) -> dict[str, float]:
        """`stats`, its counts then restarted (a server's run reports its own)."""
        out = self.stats()
        self.prompt_tokens = self.hit_tokens = 0
        return out


class _PageRows:
    """A node's extras: per layer, the family's prefilled rows of its pages' tokens (first .. first +
    pages * P - 1) that its host pages do not hold, as host copies (None where none), one item per
    page, sliced by pages when the node splits or is cut (`FamilyRuntime.prefix_rows`): copied, so
    the bytes a cut gave back are gone with the old copy, as `CopyPages` counts them."""

    def __init__(self, runtime, layers: list[tuple], first: int, pages: int):
        self.runtime, self.layers, self.first, self.pages = runtime, layers, first, pages

    def __len__(self) -> int:
        return self.pages

    def __getitem__(self, pages: slice) -> "_PageRows":
        start, stop, _ = pages.indices(self.pages)
        lo, hi = self.first + start * PAGE_TOKENS, self.first + stop * PAGE_TOKENS
        layers = [tuple(None if t is None else to_host(t) for t in self.runtime.prefix_rows(rows, lo, hi, self.first))
                  for rows in self.layers]
        return _PageRows(self.runtime, layers, lo, stop - start)
