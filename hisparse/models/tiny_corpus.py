"""The fixed text the tiny checkpoints' tokenizer learns its merges from (`hisparse.text.
train_tiny_tokenizer`): sections 1 to 3 of DESIGN.md as they read when the tokenizer was made, kept
here unchanged so the tokenizer (and every tiny checkpoint's vocabulary) is the same at every commit."""

CORPUS = """\
## 1. The system in one paragraph

Top-k sparse attention (DSA, NSA, Quest) reads only a few thousand selected KV entries per decode
step, yet serving systems keep every request's whole KV history in GPU memory so that any entry can be
selected. HiSparse keeps each request's full KV history in pinned host memory and gives each (request,
layer) a small fixed-size GPU cache. Before each sparse layer attends, one fused kernel *resolves* its
selection: finds the cached units (hits), picks exact-LRU victims for the rest (misses), copies the
missed rows straight from pinned host memory into the victim slots, and returns the GPU slot of every
selected unit, in selection order; the attention kernel reads those slots. Only KV placement changes,
so outputs are bit-for-bit the all-resident baseline's. GPU memory per request becomes bounded, so
many more long requests fit in one batch: that is where the throughput gain comes from.

## 2. Words

| word | meaning |
| --- | --- |
| unit | what a selection picks: a token (DSA), a 16-token page (Quest), a 64-token block (NSA) |
| row | the bytes of one unit in one layer (and KV head, where selection is per KV head) |
| stream | one independent cache: (request, layer) for DSA; (request, layer, KV head) where selection is per head |
| selection | the k unit ids a stream reads this step, in the order the indexer emitted them; -1 pads |
| host pool | pinned host memory holding every row of every unit of every stream |
| hot cache | the stream's B GPU slots (B >= k), plus a reserved slot for the newest token |
| resolve | the fused step: hit detection, LRU update, victim choice, miss fetch, slot output |
| miss plan | (host row, device slot) pairs of one resolve, recorded so another layer can replay them |
| anchor / shared layer | a layer that runs the indexer / a layer that reuses an anchor's selection |
| resident | the baseline: the whole KV history on the GPU, same attention kernels |
| no-IO oracle | resolve with every step but the byte copy: outputs are wrong, timing is the upper bound |

## 3. Resolve: the contract

Per stream, state: `slot_unit[B]` (unit held by each slot, -1 empty), an LRU order over the B slots,
and a unit -> slot map (dense int32: 4 bytes per unit per layer, under 1% of the KV it indexes).
Inputs per step: the selection `sel[k]` (unique ids, -1 padding) and the step's stream list. Outputs:
`slot[k]` aligned with `sel` (-1 where `sel` is -1), updated state, the miss plan, counters.

Exact LRU, defined once and implemented identically by the torch reference and the Triton kernel:
1. A selected unit found in the cache is a hit. Its slot is never a victim this step.
2. Misses are ranked in selection order; miss number m takes the m-th least-recently-used slot among
   the slots that are not hits (empty slots count as least recently used, lowest index first).
3. After the step the LRU order is: untouched slots (old relative order), then the newly filled
   misses (selection order), then the hits (selection order) as most recently used.
4. B < k is an error raised before any launch, with a message naming both numbers.

The newest token: the model writes its KV into a reserved slot and into the host pool in the same
step; it enters the LRU cache only when selected (inserting it on write would save little:
results/notes/policies.md). With page and block units the newest unit is partial and grows every
step: its write goes to the host pool and, write-through, to its cached copy where one exists, so a
stale row is never read.

Kernel shape: one program per stream; the selection and the LRU order in registers (k, B powers of
two up to 8192); hits via the unit -> slot map; victims by a prefix sum over the LRU order (stable
compaction, no sort); the misses copied by a second kernel launched back to back (one program per
stream and chunk of the miss plan), loading straight from the pinned host pointer (zero-copy).
Static shapes and device-side counts let the whole decode
step (all layers) be captured once in a CUDA graph; padded batch rows carry -1 and do nothing.
"""
