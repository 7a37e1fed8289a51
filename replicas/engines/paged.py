"""One engine step over the pages: what to read and write (``plan_batch``), and the
``MixerContext`` the model runs with (``PagedContext``).

The tokens of all items are packed in one ``[T]`` batch. For each attention pool, each
item reads the pages of the blocks from its first visible position to its last new token::

    pool's storage [num_pages, n_layers, 2, tpb, KV, hd]
    item: start s, n new tokens, window W (full: W = inf)
        lo = max(0, s + 1 - W)                  first position the first new token sees
        reads  = block_table[lo // tpb .. (s + n - 1) // tpb]
        writes = (page, slot) of positions s .. s + n - 1

A layer first writes its new K/V, then reads keys ``lo .. s+n-1`` back from ``reads``
(skipping ``lo % tpb`` slots), so earlier and new tokens come from one gather. Writes go
through the storage as rows ``[num_pages * n_layers * 2 * tpb, KV, hd]``: the plan gives
each new token its row in the pool's first layer's K, a layer adds its own offset, and one
``index_copy_`` writes K (V) of every token (advanced indexing on the 6-D storage was ~8x
slower on the CPU).

A pool whose layers cache keys and values of different widths (``AttentionSpec.v_head_dim``,
e.g. MLA's latents) keeps them side by side, ``[num_pages, n_layers, tpb, KV, hd + vd]``:
a token's row holds both, a layer's rows are ``tpb`` apart. Its layers read their history
with ``PagedContext.history`` (the mixer attends itself); ``attend`` refuses them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from replicas.engines.base import StepItem
from replicas.models.base import AttentionSpec, History, RecurrentSpec

if TYPE_CHECKING:
    from replicas.engines.torch_engine import TorchEngine


@dataclass
class SeqView:
    """One item of a step, as index data (no reference to the cache)."""

    start: int
    length: int
    reads: dict[int, tuple[int, int, int]]  # attention pool -> (lo, first, end) of read pages
    live_page: int | None


@dataclass
class Batch:
    seqs: list[SeqView]
    tokens: Tensor  # [T] new tokens of all items, packed (on the device)
    positions: Tensor  # [T]
    last: Tensor  # [len(seqs)] index of each item's last token
    writes: dict[int, Tensor]  # attention pool -> each token's row in the storage's rows
    read_pages: dict[int, Tensor]  # attention pool -> every item's read pages, concatenated
    prefill_tokens: int
    # attention pool -> the one-token items attended together: (their token rows [D],
    # their read pages padded to one width [D, P], which of those P*tpb keys each sees
    # [D, 1, 1, P*tpb]); None when fewer than two items decode.
    decode: dict[int, tuple[Tensor, Tensor, Tensor]] | None = None


def plan_batch(engine: TorchEngine, items: list[StepItem]) -> Batch:
    """Read the items' block tables into index tensors, copied to the device in one go."""
    attention = [pool for pool, kind in enumerate(engine.kinds) if kind != "recurrent"]
    ints: dict[str, list[int]] = {"tokens": [], "positions": [], "last": []}
    for pool in attention:
        ints.update({f"row{pool}": [], f"read{pool}": []})
    seqs = [_plan_seq(engine, item, attention, ints) for item in items]
    ints["last"] = list(itertools.accumulate(s.length for s in seqs))
    ints["last"] = [end - 1 for end in ints["last"]]
    sizes = [len(v) for v in ints.values()]
    flat = torch.tensor(list(itertools.chain.from_iterable(ints.values())), dtype=torch.long)
    parts = dict(zip(ints, flat.to(engine.device).split(sizes)))
    return Batch(
        seqs=seqs, tokens=parts["tokens"], positions=parts["positions"], last=parts["last"],
        writes={pool: parts[f"row{pool}"] for pool in attention},
        read_pages={pool: parts[f"read{pool}"] for pool in attention},
        prefill_tokens=sum(len(item.tokens) for item in items if item.is_prefill),
        decode=_plan_decode(engine, seqs, attention, ints),
    )


def _plan_decode(engine: TorchEngine, seqs: list[SeqView], attention: list[int],
                 ints: dict[str, list[int]]) -> dict[int, tuple[Tensor, Tensor, Tensor]] | None:
    """Index data to attend every one-token item of a pool in one batched call: each one's
    read pages padded (with page 0, masked out) to the widest, and its visible keys. Built
    on the host and copied apart from ``plan_batch``'s one flat copy (three small tensors
    per pool, only in steps with two or more decoding items)."""
    rows = [i for i, seq in enumerate(seqs) if seq.length == 1]
    if len(rows) < 2:
        return None
    tpb, device, out = engine.tokens_per_block, engine.device, {}
    token_rows = torch.tensor([ints["last"][i] for i in rows], device=device)
    for pool in attention:
        reads = [seqs[i].reads[pool] for i in rows]
        width = max(end - first for _, first, end in reads)
        pages = torch.zeros((len(rows), width), dtype=torch.long)
        visible = torch.zeros((len(rows), 1, 1, width * tpb), dtype=torch.bool)
        read = ints[f"read{pool}"]
        for r, (i, (lo, first, end)) in enumerate(zip(rows, reads)):
            pages[r, :end - first] = torch.tensor(read[first:end])
            base = lo - lo % tpb
            visible[r, 0, 0, lo - base:seqs[i].start - base + 1] = True
        out[pool] = (token_rows, pages.to(device), visible.to(device))
    return out


def _plan_seq(engine: TorchEngine, item: StepItem, attention: list[int],
              ints: dict[str, list[int]]) -> SeqView:
    start, n, tpb = item.start, len(item.tokens), engine.tokens_per_block
    end = start + n
    ints["tokens"] += item.tokens
    ints["positions"] += range(start, end)
    reads = {}
    for pool in attention:
        window = engine.windows[pool]
        lo = 0 if window is None else max(0, start + 1 - window)
        pages = item.cache.block_table(pool)[lo // tpb: (end - 1) // tpb + 1]
        if None in pages:
            raise RuntimeError(f"{item.seq_id}: a page this step needs is gone (pool "
                               f"{pool}, positions {lo}..{end - 1})")
        first = len(ints[f"read{pool}"])
        ints[f"read{pool}"] += pages
        reads[pool] = (lo, first, first + len(pages))
        base, page_rows = lo // tpb, engine.page_rows[pool]
        ints[f"row{pool}"] += (pages[p // tpb - base] * page_rows + p % tpb
                               for p in range(start, end))
    live = None
    if "recurrent" in engine.kinds:
        live = item.cache.live_state_page(engine.kinds.index("recurrent"))
        if live is None:
            raise RuntimeError(f"{item.seq_id}: no live state page; resize() first")
    return SeqView(start, n, reads, live)


def _attend_decodes(store: Tensor, slot: int, tpb: int, q: Tensor, pages: Tensor,
                    visible: Tensor, spec: AttentionSpec, sinks: Tensor | None) -> Tensor:
    """One batched attention for one-token items: q ``[D, H, hd]``, their read pages
    padded to one width ``[D, P]``, ``visible [D, 1, 1, P*tpb]`` -> ``[D, H, hd]``."""
    # index_select on the layer's K (V) view: ~5x faster on the CPU than advanced indexing
    # with the same result, and contiguous, so the reshape is a view.
    d, width = pages.shape
    flat = pages.flatten()
    keys = (torch.index_select(store[:, slot, 0], 0, flat)
            .view(d, width * tpb, *store.shape[-2:]).transpose(1, 2))  # [D, KV, S, hd]
    values = (torch.index_select(store[:, slot, 1], 0, flat)
              .view(d, width * tpb, *store.shape[-2:]).transpose(1, 2))
    return attention(q[:, :, None], keys, values, visible, spec, sinks)[:, :, 0]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: AttentionSpec,
              sinks: Tensor | None) -> Tensor:
    """Softmax attention ``[B, H, n, hd]`` over ``k``/``v [B, KV, m, hd]``: SDPA, or with
    learned sinks (a logit per head in every softmax's denominator, with no value) the
    same in plain ops. ``mask``: bool ``[.., n, m]`` or ``_CAUSAL``."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is _CAUSAL else mask, is_causal=mask is _CAUSAL,
            scale=spec.softmax_scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * spec.softmax_scale
    if mask is _CAUSAL:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs.to(v.dtype) @ v)


_CAUSAL = torch.empty(0)  # marks a mask that is plain causal (SDPA's is_causal)


class PagedContext:
    """``MixerContext`` over the pages: history from pages, new K/V and states into them.
    Masks are built once per pool and step (every layer of a pool shares them)."""

    def __init__(self, engine: TorchEngine, batch: Batch) -> None:
        self._engine, self._batch = engine, batch
        ends = list(itertools.accumulate(s.length for s in batch.seqs))
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._masks: dict[int, list[Tensor | None]] = {}
        self._live: Tensor | None = None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
               sinks: Tensor | None = None) -> Tensor:
        spec = self._engine.spec.layers[layer]
        if not spec.split_kv:
            raise ValueError(f"layer {layer}: attend needs keys and values of one width (its "
                             f"spec: {spec.head_dim} and {spec.value_dim}); use history()")
        pool, slot = self._engine.slots[layer]
        store = self._engine.storage[pool]
        read_pages, tpb = self._batch.read_pages[pool], self._engine.tokens_per_block
        rows = self._batch.writes[pool] + 2 * tpb * slot  # this layer's K rows
        flat = store.view(-1, *store.shape[-2:])
        flat.index_copy_(0, rows, k)
        flat.index_copy_(0, rows + tpb, v)
        masks = self._masks.get(pool) or self._build_masks(pool)
        decode = self._batch.decode[pool] if self._batch.decode else None
        if decode is not None and len(decode[0]) == q.shape[0]:  # every item decodes
            _, pages, visible = decode
            return _attend_decodes(store, slot, tpb, q, pages, visible, spec, sinks)
        out = torch.empty_like(q)
        if decode is not None:
            rows, pages, visible = decode
            out[rows] = _attend_decodes(store, slot, tpb, q[rows], pages, visible, spec, sinks)
        for (a, e), seq, mask in zip(self.bounds, self._batch.seqs, masks):
            if decode is not None and seq.length == 1:
                continue  # attended above, with the other one-token items
            lo, first, last = seq.reads[pool]
            read = read_pages[first:last]
            skip, m = lo % tpb, seq.start + seq.length - lo
            keys = torch.index_select(store[:, slot, 0], 0, read).flatten(0, 1)[skip:skip + m]
            values = torch.index_select(store[:, slot, 1], 0, read).flatten(0, 1)[skip:skip + m]
            # 4-D [1, heads, tokens, hd]: with 3-D inputs and a mask, CPU SDPA falls back to
            # its math kernel (~3x slower for a 2k-token prefill).
            out[a:e] = attention(q[a:e].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                 values.transpose(0, 1)[None], mask, spec,
                                 sinks)[0].transpose(0, 1)
        return out

    def history(self, layer: int, k: Tensor, v: Tensor) -> list[History]:
        spec = self._engine.spec.layers[layer]
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"layer {layer}: history() is for attention layers, its spec is "
                             f"{spec!r}")
        shape = (spec.n_kv_heads, spec.head_dim), (spec.n_kv_heads, spec.value_dim)
        if (tuple(k.shape[1:]), tuple(v.shape[1:])) != shape:
            raise ValueError(f"layer {layer}: history() takes k [T, {shape[0][0]}, "
                             f"{shape[0][1]}] and v [T, {shape[1][0]}, {shape[1][1]}], got "
                             f"{list(k.shape)} and {list(v.shape)}")
        pool, slot = self._engine.slots[layer]
        store = self._engine.storage[pool]
        read_pages, tpb = self._batch.read_pages[pool], self._engine.tokens_per_block
        if spec.split_kv:  # [P, layers, 2, tpb, KV, hd]: a layer's K rows, then its V rows
            rows = self._batch.writes[pool] + 2 * tpb * slot
            flat = store.view(-1, *store.shape[-2:])
            flat.index_copy_(0, rows, k)
            flat.index_copy_(0, rows + tpb, v)
        else:  # [P, layers, tpb, KV, hd + vd]: a token's key and value in one row
            rows = self._batch.writes[pool] + tpb * slot
            store.view(-1, *store.shape[-2:]).index_copy_(0, rows, torch.cat([k, v], dim=-1))
        masks = self._masks.get(pool) or self._build_masks(pool)
        out = []
        for seq, mask in zip(self._batch.seqs, masks):
            lo, first, last = seq.reads[pool]
            read = read_pages[first:last]
            skip, m = lo % tpb, seq.start + seq.length - lo
            if spec.split_kv:
                keys = torch.index_select(store[:, slot, 0], 0, read).flatten(0, 1)
                values = torch.index_select(store[:, slot, 1], 0, read).flatten(0, 1)
                keys, values = keys[skip:skip + m], values[skip:skip + m]
            else:
                entries = torch.index_select(store[:, slot], 0, read).flatten(0, 1)
                keys, values = entries[skip:skip + m].split([spec.head_dim, spec.value_dim],
                                                            dim=-1)
            if mask is _CAUSAL:
                mask = torch.ones(seq.length, m, dtype=torch.bool,
                                  device=keys.device).tril(m - seq.length)
            out.append(History(keys, values, lo, mask))
        return out

    def _build_masks(self, pool: int) -> list[Tensor | None]:
        """Per item: query i at ``start+i`` sees key j at ``lo+j`` when ``lo+j <= start+i``
        and, in a window W, ``lo+j > start+i-W``. None for a single query (sees them all)."""
        window, masks = self._engine.windows[pool], []
        device = self._batch.positions.device
        for (a, e), seq in zip(self.bounds, self._batch.seqs):
            if seq.length == 1:
                masks.append(None)
                continue
            lo = seq.reads[pool][0]
            if lo == seq.start and (window is None or window >= seq.length):
                masks.append(_CAUSAL)  # no history, no window cut: plain causal
                continue
            k_pos = torch.arange(lo, seq.start + seq.length, device=device)[None, :]
            q_pos = self._batch.positions[a:e, None]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            masks.append(mask)
        self._masks[pool] = masks
        return masks

    def read_states(self, layer: int) -> dict[str, Tensor]:
        """Each item's states, a copy the mixer may update in place: one ``index_select``
        of the live pages' rows (on the CPU faster than advanced indexing)."""
        pool, slot = self._engine.slots[layer]
        spec: RecurrentSpec = self._engine.pool_specs[pool]
        rows = torch.index_select(self._engine.storage[pool][:, slot], 0, self._live_pages())
        out, offset = {}, 0
        for state in spec.states:
            out[state.name] = rows[:, offset:offset + state.numel].view(-1, *state.shape)
            offset += state.numel
        return out

    def write_states(self, layer: int, states: dict[str, Tensor]) -> None:
        """Each state into its columns of the live pages' rows: an ``index_copy_`` per
        state (no concatenated copy of them all first)."""
        pool, slot = self._engine.slots[layer]
        spec: RecurrentSpec = self._engine.pool_specs[pool]
        if set(states) != {s.name for s in spec.states}:
            raise ValueError(f"layer {layer}: write_states got {sorted(states)}, its spec "
                             f"has {[s.name for s in spec.states]}")
        rows, live, offset = self._engine.storage[pool][:, slot], self._live_pages(), 0
        for s in spec.states:
            value = states[s.name].reshape(len(self.bounds), s.numel)
            rows[:, offset:offset + s.numel].index_copy_(0, live, value.to(rows.dtype))
            offset += s.numel

    def _live_pages(self) -> Tensor:
        if self._live is None:
            self._live = torch.tensor([seq.live_page for seq in self._batch.seqs],
                                      dtype=torch.long, device=self._engine.device)
        return self._live
