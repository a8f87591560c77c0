"""Prefix sharing: a prompt's whole pages stored once in the host pool and shared by every request
that extends it, prefilled once (`Server(prefix_cache=True)`; DSA in mode hisparse so far).

The host pool is then counted pages of `PAGE_TOKENS` rows behind a page table (`HostPool` pages,
`HierarchicalKVCache(page_rows=...)`), and a `PrefixIndex` remembers which token prefixes whose pages:
- admission (`take`): the longest cached prefix of the prompt, in whole pages and leaving at least one
  token to prefill. The request's streams open on its pages (each gains a holder and stays read-only
  while shared); a prefix handoff (`Handoff` of that many tokens) brings the prefix's indexer keys,
  kept by the index as host copies, into the lane and its latents, gathered from the shared pages,
  into the prefill workspace (`LanePrefill.adopt`), and the prefill runs on from there;
- the join (`insert`): the prompt's whole pages go into the index, which holds a reference to each;
- room: an admission that does not fit evicts the least recently used prefixes that only the index
  holds (a running request's streams hold their own references to the pages they read), its own
  prefix locked meanwhile; no lock outlives an admission.
"""
from __future__ import annotations

import torch

from hisparse.serving.handoff import Handoff, to_host
from hisparse.serving.prefix import Payload, PrefixIndex

PAGE_TOKENS = 64          # token rows a host page holds (DSA: one latent row a token)


class PoolPages:
    """The index's page allocator: a page-table cache's counted host pages."""

    def __init__(self, cache):
        self.cache, self.page_size = cache, cache.page_rows

    def incref(self, pages) -> None:
        self.cache.share_pages(list(pages))

    def decref(self, pages) -> None:
        self.cache.release_pages(list(pages))


class PrefixSharing:
    """A server's prefix index and what it did: tokens asked for, tokens found cached, prompt tokens
    prefilled (`stats`)."""

    def __init__(self, memory, layers: list):
        self.cache, self.layers = memory.cache, layers
        self.index = PrefixIndex(PoolPages(memory.cache), memory.streams_per_request)
        self.prompt_tokens = self.hit_tokens = 0

    def _cacheable(self, prompt: torch.Tensor) -> list[int]:
        return prompt[:len(prompt) - 1].tolist()            # one token at least is prefilled

    def admissible(self, regions: list[int], prompt: torch.Tensor) -> bool:
        """Whether streams of these capacities fit now, the cached prefix of `prompt` shared; if not,
        cached prefixes that only the index holds are evicted, least recently used first (never this
        prompt's own: locked meanwhile), as far as the pages missing, and it is asked again."""
        tokens = self._cacheable(prompt)
        length = self.index.peek(tokens)
        if self.cache.fits(regions, [length // PAGE_TOKENS] * len(regions)):
            return True
        host = self.cache.host
        missing = sum(host.pages_for(r) for r in regions) - len(regions) * (length // PAGE_TOKENS) - \
            host.free_rows // host.page_rows
        _, handle = self.index.match(tokens)
        self.index.lock(handle)
        try:
            held = lambda pages: any(host.refcount(p) > 1 for stream in pages for p in stream)  # noqa: E731
            self.index.evict(max(missing, 1), keep=held)
        finally:
            self.index.unlock(handle)
        return self.cache.fits(regions, [self.index.peek(tokens) // PAGE_TOKENS] * len(regions))

    def take(self, prompt: torch.Tensor) -> tuple[list[list[int]], Handoff] | None:
        """The prompt's cached prefix now: (its pages per stream, its handoff), or None when none is."""
        length, handle = self.index.match(self._cacheable(prompt))
        self.prompt_tokens += len(prompt)
        if not length:
            return None
        self.hit_tokens += length
        pages, pieces = handle.pages(), [piece.parts for piece in handle.extras()]
        rows = []
        for i, stream_pages in enumerate(pages):
            first = torch.tensor(stream_pages, dtype=torch.int64)[:, None] * PAGE_TOKENS
            host = (first + torch.arange(PAGE_TOKENS)).flatten()        # the pages' host rows, in token order
            keys, scales = (None if pieces[0][i][j] is None else torch.cat([piece[i][j] for piece in pieces])[None]
                            for j in range(2))                         # [1, length, Di], [1, length] (FP8 keys)
            rows.append((self.cache.host.rows[host], keys, scales))
        return pages, Handoff(length, rows, None, tokens=prompt[:length].clone())

    def insert(self, prompt: torch.Tensor, streams: list[int], lane: int) -> None:
        """A joined request's whole prompt pages into the index (those not cached yet), with host
        copies of its lane's indexer keys for them."""
        def payload(first: int, last: int) -> Payload:
            span = slice(first * PAGE_TOKENS, last * PAGE_TOKENS)
            parts = [tuple(None if t is None else to_host(t[lane, span]) for t in (kv.index_keys, kv.index_scales))
                     for kv in self.layers]
            return Payload([self.cache.stream_pages(s)[first:last] for s in streams], _PageKeys(parts, last - first))
        self.index.insert(prompt.tolist(), payload)

    def stats(self) -> dict[str, float]:
        """Prompt tokens admitted and found cached (since the last `run_stats`), the prompt tokens
        prefilled, and the host pages the index holds."""
        return {"prefix_prompt_tokens": self.prompt_tokens, "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prefill_tokens": self.prompt_tokens - self.hit_tokens,
                "prefix_cached_pages": self.index.stats()["cached_pages"]}

    def run_stats(self) -> dict[str, float]:
        """`stats`, its counts then restarted (a server's run reports its own)."""
        out = self.stats()
        self.prompt_tokens = self.hit_tokens = 0
        return out


class _PageKeys:
    """A node's indexer keys as the index's extras: per layer (keys [tokens, Di], FP8 keys' scales
    [tokens]; None where a layer has none), one item per page, sliced by pages when the node splits."""

    def __init__(self, parts: list[tuple], pages: int):
        self.parts, self.pages = parts, pages

    def __len__(self) -> int:
        return self.pages

    def __getitem__(self, pages: slice) -> "_PageKeys":
        start, stop, _ = pages.indices(self.pages)
        span = slice(start * PAGE_TOKENS, stop * PAGE_TOKENS)
        return _PageKeys([tuple(None if t is None else t[span] for t in part) for part in self.parts], stop - start)
