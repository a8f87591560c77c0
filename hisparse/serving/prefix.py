"""The prefix index: which whole pages of which token prefixes the host pool already holds.

A radix tree over token ids at page granularity (SGLang's `mem_cache/radix_cache.py` idea, our own
code): only whole pages of P tokens are shared (a 100-token prompt with P = 64 shares 64). Each node
holds a run of pages: its token ids, its page ids per stream (a request has `streams` streams: layers
x KV heads for NSA and Quest, layers for DSA) and an opaque `extras` sequence, one item per page, for
the parts a lane keeps on the GPU (DSA's indexer keys, Quest's page bounds, NSA's compressed blocks),
kept here as host copies and sliced with the pages when a node splits.

The index takes one reference (`allocator.incref`) on every page id it adopts and gives it back
(`decref`) when the page leaves it; a request's own references are its own business. Locked
prefixes (a running request reads them) are never evicted; eviction takes the least recently used
unlocked leaf pages first, from a leaf's tail, so a node is cut exactly as far as the room asked.
Recency is a counter, not a clock: a match touches the matched path, an insert the inserted one.

One index per server: its host pool, model and mode are the server's, so the key (token ids) needs
nothing else. Plain Python over counts; nothing here touches a device.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


class PageAllocator(Protocol):
    """What the index needs of the host pool's page allocator."""

    page_size: int                                  # P: token rows per page

    def incref(self, pages: Sequence[int]) -> None: ...

    def decref(self, pages: Sequence[int]) -> None: ...


@dataclass(slots=True)
class Payload:
    """The pages of one run of n whole pages: `pages[s]` the n page ids of stream s, `extras` None or
    a sequence of n items (a list, or a tensor whose first dimension is the page) sliced on splits."""

    pages: list[list[int]]
    extras: Sequence | None = None


class _Node:
    __slots__ = ("key", "pages", "extras", "parent", "children", "lock_refs", "last_use", "end")

    def __init__(self, key: tuple, pages: list[list[int]], extras, parent: _Node | None, end: int):
        self.key = key                      # token ids, a multiple of P long
        self.pages = pages                  # [streams][len(key) // P] page ids
        self.extras = extras
        self.parent = parent
        self.children: dict[tuple, _Node] = {}      # by the child's first page of token ids
        self.lock_refs = 0
        self.last_use = 0
        self.end = end                      # tokens from the root to this node's end


@dataclass(frozen=True, slots=True)
class PrefixHandle:
    """A matched (or inserted) prefix: `length` tokens, a multiple of P. Lock it before the next
    evict; a handle whose prefix was cut since (`PrefixIndex.lock` says so) is matched again."""

    node: _Node
    length: int

    def pages(self) -> list[list[int]]:
        """Page ids per stream of the whole prefix, in token order: [streams][length // P]."""
        path = self._path()
        return [[p for node in path for p in node.pages[s]] for s in range(len(self.node.pages))]

    def extras(self) -> list:
        """The extras of the prefix, one piece per tree node in token order (each piece's items are
        pages); the caller concatenates them as its type wants."""
        return [node.extras for node in self._path()]

    def _path(self) -> list[_Node]:
        path, node = [], self.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]


class PrefixIndex:
    """A radix tree of cached prefixes over `allocator`'s pages, `streams` page ids per page of tokens."""

    def __init__(self, allocator: PageAllocator, streams: int):
        page_size = getattr(allocator, "page_size", None)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"allocator.page_size = {page_size!r}: expected a positive integer (token rows a page)")
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams = {streams!r}: expected a positive integer (page ids per page of tokens)")
        self.allocator, self.page_size, self.streams = allocator, page_size, streams
        self._clock = itertools.count(1)
        self.root = _Node((), [[] for _ in range(streams)], None, None, 0)
        self.cached_pages = 0           # page ids held (streams per page of tokens)
        self.changes = 0                # insertions, cuts and clears: what the index holds changed
        self.lookups = 0                # match calls
        self.lookup_tokens = 0          # whole-page tokens asked for (the most a match could hit)
        self.hit_tokens = 0             # tokens matched

    # -- lookups ------------------------------------------------------------------------------------

    def match(self, tokens) -> tuple[int, PrefixHandle]:
        """The longest cached prefix of `tokens` (a multiple of P tokens, maybe 0) and its handle;
        the path is used now (least recently used last). A node matched part way is split there."""
        key = self._key(tokens)
        node, length = self._walk(key, split=True)
        self._touch(node)
        self.lookups += 1
        self.lookup_tokens += len(key)
        self.hit_tokens += length
        return length, PrefixHandle(node, length)

    def peek(self, tokens) -> int:
        """The length `match` would give, with nothing changed: no split, no count, no recency."""
        return self._walk(self._key(tokens), split=False)[1]

    def lock(self, handle: PrefixHandle) -> None:
        """Keep the handle's prefix (and so every node above it) from eviction until `unlock`."""
        self._check_live(handle)
        node = handle.node
        while node is not self.root:
            node.lock_refs += 1
            node = node.parent

    def unlock(self, handle: PrefixHandle) -> None:
        self._check_live(handle)
        if handle.node is not self.root and handle.node.lock_refs < 1:
            raise ValueError(f"unlock of a prefix of {handle.length} tokens that is not locked")
        node = handle.node
        while node is not self.root:
            node.lock_refs -= 1
            node = node.parent

    # -- changes --------------------------------------------------------------------------------------

    def insert(self, tokens, payload_fn: Callable[[int, int], Payload]) -> PrefixHandle:
        """Cache the whole pages of `tokens` (a prompt after its prefill, with its generated tokens if
        the caller likes). Pages already cached are kept and reused; for the new ones, pages [first,
        last) of the request, `payload_fn(first, last)` gives their Payload, checked before anything
        changes, and the index increfs them. Returns the handle of the whole-page prefix."""
        key = self._key(tokens)
        node, length = self._walk(key, split=False)
        pages = (len(key) - length) // self.page_size
        payload = None
        if pages:
            first = length // self.page_size
            payload = payload_fn(first, first + pages)
            self._check_payload(payload, pages, first)
        node, length = self._walk(key, split=True)       # the same place, now a node boundary
        if payload is not None:
            leaf = _Node(key[length:], [list(p) for p in payload.pages], payload.extras, node, len(key))
            node.children[leaf.key[:self.page_size]] = leaf
            self.allocator.incref([p for stream in leaf.pages for p in stream])
            self.cached_pages += pages * self.streams
            self.changes += 1
            node = leaf
        self._touch(node)
        return PrefixHandle(node, len(key))

    def evict(self, pages_needed: int, keep: Callable[[list[list[int]]], bool] | None = None) -> int:
        """Give back at least `pages_needed` page ids (fewer only when nothing unlocked is left),
        least recently used leaf pages first, each from its leaf's tail; returns the page ids given
        back (a multiple of `streams`). A page goes back to the free list once no request holds it.
        keep(a leaf's pages per stream): True leaves that leaf alone (e.g. a running request holds it)."""
        if isinstance(pages_needed, bool) or not isinstance(pages_needed, int) or pages_needed < 0:
            raise ValueError(f"pages_needed = {pages_needed!r}: expected an integer >= 0")
        leaves = [(n.last_use, id(n), n) for n in self._nodes()
                  if not n.children and not n.lock_refs and not (keep and keep(n.pages))]
        heapq.heapify(leaves)
        freed = 0
        while freed < pages_needed and leaves:
            _, _, node = heapq.heappop(leaves)
            cut = min(len(node.key) // self.page_size, -(-(pages_needed - freed) // self.streams))
            parent = self._cut_tail(node, cut)
            freed += cut * self.streams
            if parent is None:                            # the rest of it is still the same leaf
                heapq.heappush(leaves, (node.last_use, id(node), node))
            elif parent is not self.root and not parent.children and not parent.lock_refs and \
                    not (keep and keep(parent.pages)):
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))
        return freed

    def all_extras(self) -> list:
        """Every node's extras (None where a node has none)."""
        return [n.extras for n in self._nodes()]

    def unlocked_pages(self) -> list[list[int]]:
        """The page ids, per stream, of every node no lock holds: at most what `evict` may give back."""
        return [stream for n in self._nodes() if not n.lock_refs for stream in n.pages]

    def clear(self) -> int:
        """Give back every page (refused while a prefix is locked); returns the page ids given back."""
        locked = sum(1 for n in self._nodes() if n.lock_refs)
        if locked:
            raise ValueError(f"clear() with {locked} locked prefix nodes: unlock every request's prefix first")
        freed = self.cached_pages
        for node in self._nodes():
            self.allocator.decref([p for stream in node.pages for p in stream])
            node.parent = None
        self.root.children.clear()
        self.cached_pages = 0
        self.changes += 1
        return freed

    # -- counters -------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """cached_pages, evictable_pages (unlocked), lookups, lookup_tokens, hit_tokens, hit_rate."""
        evictable = sum(len(n.key) // self.page_size for n in self._nodes() if not n.lock_refs) * self.streams
        return dict(cached_pages=self.cached_pages, evictable_pages=evictable, lookups=self.lookups,
                    lookup_tokens=self.lookup_tokens, hit_tokens=self.hit_tokens,
                    hit_rate=self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0)

    # -- inside ---------------------------------------------------------------------------------------

    def _key(self, tokens) -> tuple:
        """The whole pages of `tokens` (a 1-D tensor or a sequence of ints) as a tuple of ints."""
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        if any(isinstance(t, list) for t in ids):
            raise ValueError(f"tokens: expected one sequence of token ids, got a nested one of {len(ids)} rows")
        return tuple(int(t) for t in ids[:len(ids) - len(ids) % self.page_size])

    def _walk(self, key: tuple, split: bool) -> tuple[_Node, int]:
        """The deepest node whose prefix `key` starts with, page by page, and the tokens matched;
        with split, a node matched part way is split so that the match ends on a node."""
        P, node, length = self.page_size, self.root, 0
        while length < len(key):
            child = node.children.get(key[length:length + P])
            if child is None:
                break
            same = P                     # the first page matched by the dict
            while same < len(child.key) and key[length + same:length + same + P] == child.key[same:same + P]:
                same += P
            if same < len(child.key):
                if split:
                    child = self._split(child, same)
                else:
                    return node, length + same
            node, length = child, length + same
        return node, length

    def _split(self, node: _Node, tokens: int) -> _Node:
        """Cut `node` after `tokens` tokens (a page boundary): a new parent holds the first part (and
        the node's locks: every lock on the node passes through it); the node keeps the rest."""
        at = tokens // self.page_size
        extras = node.extras
        head = _Node(node.key[:tokens], [p[:at] for p in node.pages], None if extras is None else extras[:at],
                     node.parent, node.end - len(node.key) + tokens)
        head.lock_refs, head.last_use = node.lock_refs, node.last_use
        node.parent.children[head.key[:self.page_size]] = head
        node.key, node.pages = node.key[tokens:], [p[at:] for p in node.pages]
        node.extras = None if extras is None else extras[at:]
        node.parent = head
        head.children[node.key[:self.page_size]] = node
        return head

    def _cut_tail(self, node: _Node, pages: int) -> _Node | None:
        """Give back the last `pages` pages of leaf `node`; all of them: the node leaves the tree (its
        parent None, so its handles are stale) and its old parent is returned, else None."""
        keep = len(node.key) // self.page_size - pages
        self.allocator.decref([p for stream in node.pages for p in stream[keep:]])
        self.cached_pages -= pages * self.streams
        self.changes += 1
        node.end -= pages * self.page_size
        if keep == 0:
            parent, node.parent = node.parent, None
            del parent.children[node.key[:self.page_size]]
            return parent
        node.key = node.key[:keep * self.page_size]
        node.pages = [p[:keep] for p in node.pages]
        node.extras = None if node.extras is None else node.extras[:keep]
        return None

    def _touch(self, node: _Node) -> None:
        tick = next(self._clock)
        while node is not None:
            node.last_use = tick
            node = node.parent

    def _nodes(self) -> list[_Node]:
        out, todo = [], list(self.root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def _check_live(self, handle: PrefixHandle) -> None:
        node = handle.node
        while node is not self.root and node is not None:
            node = node.parent
        if node is None or handle.node.end != handle.length:
            raise ValueError(f"the handle's prefix of {handle.length} tokens was evicted or cut since it was "
                             f"matched: match again (lock a handle before the next evict)")

    def _check_payload(self, payload: Payload, pages: int, first: int) -> None:
        where = f"payload_fn({first}, {first + pages})"
        if not isinstance(payload, Payload):
            raise ValueError(f"{where} returned {type(payload).__name__}: expected a Payload")
        if len(payload.pages) != self.streams or any(len(p) != pages for p in payload.pages):
            got = [len(p) for p in payload.pages]
            raise ValueError(f"{where}: pages per stream {got}: expected {self.streams} streams of {pages} pages")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for s in payload.pages for p in s):
            raise ValueError(f"{where}: page ids must be integers >= 0")
        if payload.extras is not None and len(payload.extras) != pages:
            raise ValueError(f"{where}: extras of {len(payload.extras)} items: expected one per page, {pages}")
