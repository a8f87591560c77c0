"""The prefix index (hisparse.serving.prefix) over a fake page allocator that checksums: each page
holds a checksum of its stream and the whole prefix it ends, poisoned when freed, so a match that
hands out a wrong, misplaced or freed page is caught. Longest match, node splits, LRU eviction
order, locks, refcounts back to zero, bad payloads refused with nothing changed, and a churn of
1,000 operations against a brute-force model (every cached page-prefix with its last use)."""
import itertools
import random

import pytest
import torch

from hisparse.serving.prefix import Payload, PrefixIndex


class FakeAllocator:
    """Pages with reference counts and contents; a freed page is poisoned and reused first."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.refs, self.content, self.free, self.next_id = {}, {}, [], 0

    def alloc(self, checksum) -> int:
        page = self.free.pop() if self.free else self.next_id
        self.next_id += page == self.next_id
        self.refs[page], self.content[page] = 1, checksum
        return page

    def incref(self, pages):
        for p in pages:
            assert self.refs.get(p, 0) > 0, f"incref of free page {p}"
            self.refs[p] += 1

    def decref(self, pages):
        for p in pages:
            assert self.refs.get(p, 0) > 0, f"decref of free page {p}"
            self.refs[p] -= 1
            if not self.refs[p]:
                del self.refs[p]
                self.content[p] = "poison"
                self.free.append(p)


def checksum(stream: int, prefix) -> tuple:
    return (stream, tuple(prefix))


def serve(index: PrefixIndex, alloc: FakeAllocator, tokens, calls=None):
    """A request's prefill: its own pages for every whole page, the new ones given to the index, then
    the request ends (its own references go). Returns the inserted handle."""
    P, n = alloc.page_size, len(tokens) // alloc.page_size
    own = [[alloc.alloc(checksum(s, tokens[:(j + 1) * P])) for j in range(n)] for s in range(index.streams)]

    def payload(first, last):
        if calls is not None:
            calls.append((first, last))
        return Payload([own[s][first:last] for s in range(index.streams)],
                       extras=[tuple(tokens[:(j + 1) * P]) for j in range(first, last)])
    handle = index.insert(tokens, payload)
    alloc.decref([p for s in own for p in s])
    return handle


def check_handle(alloc: FakeAllocator, handle, tokens):
    """Every page of the handle is live and holds its stream's checksum of the prefix it ends."""
    P = alloc.page_size
    pages = handle.pages()
    for s, stream in enumerate(pages):
        assert len(stream) == handle.length // P
        for j, page in enumerate(stream):
            assert alloc.refs.get(page, 0) > 0 and alloc.content[page] == checksum(s, tokens[:(j + 1) * P])
    extras = [item for piece in handle.extras() for item in piece]
    assert extras == [tuple(tokens[:(j + 1) * P]) for j in range(handle.length // P)]


def cached(index: PrefixIndex) -> set:
    """Every cached whole-page prefix, read without touching recency."""
    out, todo = set(), [(index.root, ())]
    while todo:
        node, prefix = todo.pop()
        for child in node.children.values():
            full = prefix + child.key
            out.update(full[:j] for j in range(len(prefix) + index.page_size, len(full) + 1, index.page_size))
            todo.append((child, full))
    return out


def test_longest_match_is_whole_pages():
    """P = 4: a 10-token prompt caches 8; a prompt sharing 9 tokens with it matches 8, one sharing 7
    matches 4, one differing in its first token 0 (the root's handle)."""
    alloc = FakeAllocator(4)
    index = PrefixIndex(alloc, streams=3)
    prompt = list(range(10))
    h = serve(index, alloc, prompt)
    assert h.length == 8 and index.cached_pages == 2 * 3
    for probe, want in [(prompt[:9] + [99, 98, 97], 8), (prompt[:7] + [50] * 5, 4), ([77] + prompt[1:], 0),
                        (prompt[:3], 0), (torch.tensor(prompt + [1] * 7), 8)]:
        length, handle = index.match(probe)
        assert length == handle.length == want
        check_handle(alloc, handle, list(probe))
    s = index.stats()
    assert s["lookups"] == 5 and s["hit_tokens"] == 20 and s["lookup_tokens"] == 12 + 12 + 8 + 0 + 16


def test_insert_splits_on_page_boundaries_and_reuses_cached_pages():
    """Two prompts sharing 2 of 3 pages: the second adopts only its last page, the tree splits the
    first's node after 2 pages, both match in full, and the shared pages are the first's."""
    alloc = FakeAllocator(2)
    index = PrefixIndex(alloc, streams=2)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9]
    calls = []
    ha = serve(index, alloc, a, calls)
    hb = serve(index, alloc, b, calls)
    assert calls == [(0, 3), (2, 3)] and index.cached_pages == 4 * 2
    assert len(ha._path()) == 2 and len(hb._path()) == 2 and ha._path()[0] is hb._path()[0]
    assert ha.pages()[0][:2] == hb.pages()[0][:2] and ha.pages()[1][2] != hb.pages()[1][2]
    for tokens in (a, b):
        length, handle = index.match(tokens)
        assert length == 6
        check_handle(alloc, handle, tokens)
    calls.clear()
    assert serve(index, alloc, a + [0, 0], calls).length == 8 and calls == [(3, 4)]
    assert serve(index, alloc, a[:4], calls).length == 4 and calls == [(3, 4)]       # nothing new: no call
    assert cached(index) == {tuple(a[:2]), tuple(a[:4]), tuple(a), tuple(a + [0, 0]), tuple(b[:6])}


def test_eviction_takes_least_recently_used_leaf_pages_first():
    """Three prompts; matching the first makes it the most recent. Evicting one page at a time takes
    the second's, the third's, then the first's tail; asking for part of a page's streams frees the
    whole page (3 streams), asking for more than is cached frees everything."""
    alloc = FakeAllocator(2)
    index = PrefixIndex(alloc, streams=3)
    first, second, third = [1, 1, 2, 2], [5, 5], [7, 7]
    for tokens in (first, second, third):
        serve(index, alloc, tokens)
    index.match(first)
    assert index.evict(1) == 3 and cached(index) == {(1, 1), (1, 1, 2, 2), (7, 7)}
    assert index.evict(3) == 3 and cached(index) == {(1, 1), (1, 1, 2, 2)}
    assert index.evict(2) == 3 and cached(index) == {(1, 1)}
    assert index.evict(0) == 0
    assert index.evict(100) == 3 and cached(index) == set() and not alloc.refs
    assert index.evict(5) == 0


def test_locked_prefixes_and_their_ancestors_are_never_evicted():
    alloc = FakeAllocator(2)
    index = PrefixIndex(alloc, streams=1)
    a, b = [1, 2, 3, 4], [1, 2, 5, 6]
    serve(index, alloc, a)
    serve(index, alloc, b)
    length, handle = index.match(a)
    index.lock(handle)
    index.lock(handle)                    # two requests read it
    assert index.evict(100) == 1 and cached(index) == {(1, 2), (1, 2, 3, 4)}
    assert index.stats()["evictable_pages"] == 0
    with pytest.raises(ValueError, match=r"clear\(\) with 2 locked prefix nodes"):
        index.clear()
    index.unlock(handle)
    assert index.evict(100) == 0
    index.unlock(handle)
    with pytest.raises(ValueError, match=r"not locked"):
        index.unlock(handle)
    assert index.evict(1) == 1 and cached(index) == {(1, 2)}
    with pytest.raises(ValueError, match=r"was evicted or cut since it was matched: match again"):
        index.lock(handle)                # its prefix is gone: a stale handle is refused
    assert index.match(a)[0] == 2


def test_a_lock_taken_before_a_split_holds_both_halves():
    """Locking a 3-page prefix, then inserting one that shares 1 page splits its node: the lock holds
    the new parent too, and unlocking leaves nothing locked."""
    alloc = FakeAllocator(2)
    index = PrefixIndex(alloc, streams=1)
    a = [1, 1, 2, 2, 3, 3]
    handle = serve(index, alloc, a)
    index.lock(handle)
    serve(index, alloc, [1, 1, 9, 9])
    assert index.evict(100) == 1 and cached(index) == {(1, 1), (1, 1, 2, 2), tuple(a)}
    index.unlock(handle)
    assert index.stats()["evictable_pages"] == 3 and index.evict(100) == 3 and not alloc.refs


def test_clear_brings_every_refcount_back_to_zero():
    alloc = FakeAllocator(3)
    index = PrefixIndex(alloc, streams=4)
    for tokens in ([1] * 9, [1] * 6 + [2] * 4, [3] * 5):
        serve(index, alloc, tokens)
    assert alloc.refs and all(r == 1 for r in alloc.refs.values()) and len(alloc.refs) == index.cached_pages
    assert index.clear() == 5 * 4 and not alloc.refs and index.cached_pages == 0
    assert index.match([1] * 9)[0] == 0 and cached(index) == set()


@pytest.mark.parametrize("bad,message", [
    (lambda a, b: [[0]], r"payload_fn\(1, 3\) returned list: expected a Payload"),
    (lambda a, b: Payload([[0, 1]]), r"pages per stream \[2\]: expected 2 streams of 2 pages"),
    (lambda a, b: Payload([[0], [1]]), r"pages per stream \[1, 1\]: expected 2 streams of 2 pages"),
    (lambda a, b: Payload([[0, -1], [2, 3]]), r"page ids must be integers >= 0"),
    (lambda a, b: Payload([[0, 1], [2, 3]], extras=[1]), r"extras of 1 items: expected one per page, 2"),
], ids=["not-payload", "streams", "pages", "negative", "extras"])
def test_a_bad_payload_is_refused_and_changes_nothing(bad, message):
    alloc = FakeAllocator(2)
    index = PrefixIndex(alloc, streams=2)
    serve(index, alloc, [1, 1, 2, 2])
    before, refs = cached(index), dict(alloc.refs)
    with pytest.raises(ValueError, match=message):
        index.insert([1, 1, 2, 3, 4, 4], bad)          # splits after 1 page, adopts 2: refused first
    assert cached(index) == before and alloc.refs == refs and len(index.root.children) == 1
    assert len(next(iter(index.root.children.values())).key) == 4          # not split


@pytest.mark.parametrize("kw,message", [
    (dict(page_size=0), r"allocator.page_size = 0: expected a positive integer"),
    (dict(streams=0), r"streams = 0: expected a positive integer"),
])
def test_bad_sizes_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        PrefixIndex(FakeAllocator(kw.get("page_size", 2)), kw.get("streams", 1))
    with pytest.raises(ValueError, match=r"pages_needed = -1: expected an integer >= 0"):
        PrefixIndex(FakeAllocator(2), 1).evict(-1)


class Model:
    """Brute force: every cached page-prefix with the tick of its last use; locks as prefixes."""

    def __init__(self, P, streams):
        self.P, self.streams, self.tick, self.use, self.locks = P, streams, 0, {}, []

    def prefixes(self, tokens):
        return [tuple(tokens[:j]) for j in range(self.P, len(tokens) + 1, self.P)]

    def touch(self, prefixes):
        self.tick += 1
        for p in prefixes:
            self.use[p] = self.tick

    def match(self, tokens):
        hit = list(itertools.takewhile(lambda p: p in self.use, self.prefixes(tokens)))
        self.touch(hit)
        return len(hit) * self.P

    def evict(self, needed):
        freed = 0
        while freed < needed:
            leaves = [p for p in self.use if not any(len(q) == len(p) + self.P and q[:len(p)] == p for q in self.use)
                      and not any(lock[:len(p)] == p for lock in self.locks)]
            if not leaves:
                break
            oldest = min(self.use[p] for p in leaves)
            victims = [p for p in leaves if self.use[p] == oldest]
            assert len(victims) == 1            # one leaf per tick: LRU order has no ties to break
            del self.use[victims[0]]
            freed += self.streams
        return freed


def test_random_churn_against_a_brute_force_model():
    """1,000 random inserts, matches (some locked at once), unlocks and evictions over a 3-token
    vocabulary (prompts share a lot) with P = 2 and 2 streams: every match's length, pages and
    extras, every eviction's count and the cached set as the model says; refcounts exact; the hit
    counters the model's sum; clear at the end leaves no page held."""
    rng = random.Random(59)
    P, streams = 2, 2
    alloc = FakeAllocator(P)
    index, model = PrefixIndex(alloc, streams), Model(P, streams)
    held, seen, hits = [], [[]], 0

    def prompt():
        base = rng.choice(seen)
        cut = rng.randrange(0, len(base) + 1)
        return base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 9))]
    for _ in range(1000):
        op = rng.random()
        if op < 0.35:
            tokens = prompt()
            seen.append(tokens)
            handle = serve(index, alloc, tokens)
            model.touch(model.prefixes(tokens))
            assert handle.length == len(tokens) // P * P
            check_handle(alloc, handle, tokens)
        elif op < 0.7:
            tokens = prompt()
            length, handle = index.match(tokens)
            want = model.match(tokens)
            hits += want
            assert length == want
            check_handle(alloc, handle, tokens)
            if rng.random() < 0.4:
                index.lock(handle)
                held.append(handle)
                model.locks.append(tuple(tokens[:length]))
        elif op < 0.85 and held:
            i = rng.randrange(len(held))
            index.unlock(held.pop(i))
            model.locks.pop(i)
        else:
            needed = rng.randrange(0, 12)
            assert index.evict(needed) == model.evict(needed)
        assert cached(index) == set(model.use)
        assert index.cached_pages == len(model.use) * streams == len(alloc.refs)
        assert all(r == 1 for r in alloc.refs.values())       # the index's reference only: the requests ended
    assert index.stats()["hit_tokens"] == hits and hits > 0
    for handle in held:
        index.unlock(handle)
    index.clear()
    assert not alloc.refs
