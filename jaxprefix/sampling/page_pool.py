"""The continuous sampler's KV pages: pools, page tables with their accounting, and the writes.

Where a page lies in a pool and what it weighs is `paged_attention.PageLayout`'s business (the one
owner of that arithmetic); here are what the decode loop does with pages:
  - the rows' pool: each block of rows owns `pages` pages per layer. A row's page table lists
    the pages that hold its own tokens, in order (page i: its tokens i * page_size ..). Free
    pages sit on a stack per block. `grow` hands the top free page to each row about to write
    the first token of a page, `release` takes rows' pages back, `write_tokens` puts each
    active row's new token's K and V in its page, in place;
  - the accounting (`PageTables.unreserved`, `PageTables.preempt`): a row is promised `reserve`
    pages when it starts; it starts only when that many are free and unpromised, and when rows
    need more pages than are free the fewest youngest give theirs back (preempted);
  - a context pool per context segment (prompt, suffix): group slot k of a block owns pages
    k * W .. (k + 1) * W - 1 (`slot_tables`); `write_slots` puts admitted contexts' KV there.
All of it is arrays in the decode loop's carry, changed by vectorised, pure functions.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxprefix.models import paged_attention
from jaxprefix.models.sharding import logical_spec


@flax.struct.dataclass
class PageTables:
    """Per block (leading [D] axis): the free-page stack and every row's pages."""
    free: jax.Array   # int32 [D, pages]: free[d, :count[d]] are the block's free page ids
    count: jax.Array  # int32 [D]
    table: jax.Array  # int32 [D, R, W]: row r's i-th page (valid for i < held[d, r])
    held: jax.Array   # int32 [D, R]: pages row r holds

    @classmethod
    def empty(cls, blocks: int, pages: int, rows: int, pages_per_row: int) -> PageTables:
        return cls(free=jnp.tile(jnp.arange(pages, dtype=jnp.int32), (blocks, 1)),
                   count=jnp.full((blocks,), pages, jnp.int32),
                   table=jnp.zeros((blocks, rows, pages_per_row), jnp.int32),
                   held=jnp.zeros((blocks, rows), jnp.int32))

    def unreserved(self, promised: jax.Array, reserve: int) -> jax.Array:
        """[D] free pages not promised to a row: each row marked in promised [D, R] is promised
        `reserve` pages in all, of which it holds some already."""
        owed = jnp.where(promised, jnp.maximum(reserve - self.held, 0), 0)
        return self.count - owed.sum(axis=1)

    def preempt(self, active: jax.Array, started: jax.Array,
                needs: jax.Array) -> tuple[PageTables, jax.Array]:
        """Where a block's active rows need more pages this step than are free (needs [D, R]),
        the fewest youngest of them (`started` [D, R]: the step each started at) give every page
        back. Returns (tables, the preempted rows [D, R])."""
        preempted = jax.vmap(youngest_to_preempt)(active, started, self.held, self.count, needs)
        return release(self, preempted), preempted


def youngest_to_preempt(active, started, held, count, needs):
    """One block's rows [R] to preempt: the fewest youngest active rows whose pages, given back,
    cover what the others need (none when `count` free pages already do)."""
    r = active.shape[0]
    age = jnp.where(active, started * r + jnp.arange(r), -1)  # larger: younger
    order = jnp.argsort(-age)  # youngest first (inactive rows last)
    freed = jnp.cumsum(jnp.where(active, held, 0)[order])
    spared = jnp.cumsum(needs[order])
    total = needs.sum()
    enough = count + freed >= total - spared  # after preempting the m + 1 youngest
    m = jnp.where(count >= total, -1, jnp.argmax(enough))
    return jnp.zeros(r, bool).at[order].set(jnp.arange(r) <= m) & active


def _grow_block(free, count, table, held, needs):
    rank = jnp.cumsum(needs) - 1
    page = free[jnp.clip(count - 1 - rank, 0, free.shape[0] - 1)]
    rows = jnp.arange(table.shape[0])
    at = jnp.where(needs, held, table.shape[1])  # past the end: dropped
    table = table.at[rows, at].set(page, mode='drop')
    return count - needs.sum(dtype=jnp.int32), table, held + needs.astype(jnp.int32)


def grow(tables: PageTables, needs: jax.Array) -> PageTables:
    """Rows with needs [D, R] each take one free page (the caller made sure there are enough)."""
    count, table, held = jax.vmap(_grow_block)(tables.free, tables.count, tables.table,
                                               tables.held, needs)
    return tables.replace(count=count, table=table, held=held)


def _release_block(free, count, table, held, rows):
    width = table.shape[1]
    owned = rows[:, None] & (jnp.arange(width)[None, :] < held[:, None])  # [R, W]
    rank = jnp.cumsum(owned.reshape(-1)) - 1
    at = jnp.where(owned.reshape(-1), count + rank, free.shape[0])
    free = free.at[at].set(table.reshape(-1), mode='drop')
    return free, count + owned.sum(dtype=jnp.int32), jnp.where(rows, 0, held)


def release(tables: PageTables, rows: jax.Array) -> PageTables:
    """Every page of the rows marked in rows [D, R] goes back on its block's free stack."""
    free, count, held = jax.vmap(_release_block)(tables.free, tables.count, tables.table,
                                                 tables.held, rows)
    return tables.replace(free=free, count=count, held=held)


@flax.struct.dataclass
class Pool:
    """The pages' keys and values in the arrays its `layout` describes (int8 pools: with
    per-token scales)."""
    k: tuple
    v: tuple
    k_scale: tuple | None
    v_scale: tuple | None
    layout: paged_attention.PageLayout = flax.struct.field(pytree_node=False)

    @classmethod
    def empty(cls, layout: paged_attention.PageLayout) -> Pool:
        return cls.of(layout.empty(), layout)

    def arrays(self) -> list[tuple]:
        """(k, v, k_scale, v_scale) of each array."""
        scales = lambda x: (None,) * len(self.k) if x is None else x
        return list(zip(self.k, self.v, scales(self.k_scale), scales(self.v_scale)))

    @classmethod
    def of(cls, arrays: list[tuple], layout: paged_attention.PageLayout) -> Pool:
        k, v, ks, vs = (tuple(x) for x in zip(*arrays))
        return cls(k, v, None if ks[0] is None else ks, None if vs[0] is None else vs, layout)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def view(self, table: jax.Array, lengths: jax.Array, first_position: jax.Array,
             name: str) -> paged_attention.PagedKV:
        """What the model reads in a decode step: groups [G] with their tables [G, W], lengths
        and first positions; `name` says what they hold."""
        return paged_attention.PagedKV(self.k, self.v, self.k_scale, self.v_scale, table=table,
                                       lengths=lengths, first_position=first_position,
                                       layout=self.layout, name=name)


def context_layout(rows: paged_attention.PageLayout, slots: int,
                   length: int) -> paged_attention.PageLayout:
    """A context segment's pool: `slots` group slots a block of `length` tokens each, in pages
    of the rows' size (or one page of the segment, if shorter)."""
    page_size = min(rows.page_size, length)
    return dataclasses.replace(rows, pages=slots * length // page_size, page_size=page_size)


def slot_tables(layout: paged_attention.PageLayout, slots: int) -> jax.Array:
    """int32 [D * K, W] of a context pool: group slot k of each block reads its pages
    k * W .. k * W + W - 1."""
    per_slot = layout.pages // slots
    table = jnp.arange(slots * per_slot, dtype=jnp.int32).reshape(slots, per_slot)
    return jnp.tile(table, (layout.blocks, 1))


def write_slots(pool: Pool, new_k: jax.Array, new_v: jax.Array, target: jax.Array) -> Pool:
    """A context pool with admitted contexts' KV new_k, new_v [L, D * F, S, Hkv, Dh] written at
    group slots target [D, F] of each block (target >= K: dropped), S tokens a slot, page by
    page. Under a mesh each device writes its own block and KV heads (shard_map)."""
    _, _, length, _, dh = new_k.shape
    d, admit = target.shape
    layout = pool.layout
    page_size = layout.page_size
    per_slot = length // page_size
    slots = layout.pages // per_slot  # K: group slots a block

    def local(k, v, ks, vs, new_k, new_v, target):
        layers = new_k.shape[0]  # the array's

        def paged(x):  # [L, S, Hkv, Dh] -> [L * W, Hkv, page_size, Dh]
            x = x.reshape(layers, per_slot, page_size, -1, dh).transpose(0, 1, 3, 2, 4)
            return x.reshape(-1, x.shape[2], page_size, dh)

        # One context at a time: the temporaries (int8: its quantization) are one context's.
        def one(f, arrays):
            slot = target[0, f]
            pages = layout.index(jnp.arange(layers)[:, None],
                                 slot * per_slot + jnp.arange(per_slot)[None, :]).reshape(-1)
            valid = jnp.broadcast_to(slot < slots, pages.shape)
            return _write(arrays, paged(new_k[:, f]), paged(new_v[:, f]), pages,
                          jnp.zeros_like(pages), valid)
        return jax.lax.fori_loop(0, admit, one, (k, v, ks, vs))

    return _per_array(local, pool, new_k, new_v, target)


def write_tokens(pool: Pool, new_k: jax.Array, new_v: jax.Array, table: jax.Array,
                 t: jax.Array, active: jax.Array) -> Pool:
    """The pool with each active row's new token (own index t) written to its page, in place.

    new_k, new_v [L, B, 1, Hkv, Dh] (the model's new-token KVSegment), table [B, W], t and
    active [B]. Under a mesh each device writes its own rows and KV heads.
    """
    layout = pool.layout
    page_size = layout.page_size

    def local(k, v, ks, vs, new_k, new_v, table, t, active):
        layers = new_k.shape[0]  # the array's
        rows = jnp.arange(table.shape[0])
        page = table[rows, jnp.minimum(t // page_size, table.shape[1] - 1)]
        at = layout.index(jnp.arange(layers)[:, None], page[None, :]).reshape(-1)  # [L * B]
        slot = jnp.broadcast_to(t % page_size, (layers, t.shape[0])).reshape(-1)
        valid = jnp.broadcast_to(active, (layers, t.shape[0])).reshape(-1)
        tokens = lambda x: x.reshape(-1, *x.shape[2:]).swapaxes(1, 2)  # [L * B, Hkv, 1, Dh]
        return _write((k, v, ks, vs), tokens(new_k), tokens(new_v), at, slot, valid)

    return _per_array(local, pool, new_k, new_v, table, t, active)


def _write(arrays, keys, values, pages, slots, valid):
    """(k, v, k_scale, v_scale) with keys and values [N, Hkv, T, Dh] at pages[n], slots
    slots[n].. where valid[n] (int8 pools: quantized, with their scales)."""
    k, v, ks, vs = arrays
    if ks is not None:
        keys, key_scales = paged_attention.quantize(keys)
        values, value_scales = paged_attention.quantize(values)
        ks = _write_pages(ks, key_scales, pages, slots, valid)
        vs = _write_pages(vs, value_scales, pages, slots, valid)
    return (_write_pages(k, keys, pages, slots, valid),
            _write_pages(v, values, pages, slots, valid), ks, vs)


def _write_pages(pool: jax.Array, new: jax.Array, pages: jax.Array, slots: jax.Array,
                 valid: jax.Array) -> jax.Array:
    """One device's `pool` [Hkv, P, page_size, ...] with new [N, Hkv, T, ...] written at pages
    pages[n], slots slots[n] .. + T - 1, where valid[n], in place.

    The scatter indexes the pool as [Hkv * P, page_size, ...]: scattering into [Hkv, P, ...]
    led XLA's TPU layout assignment to give the pool another layout than the paged kernel reads
    and to copy the whole pool into the kernel's at every step (tests/test_paged_attention.py)."""
    hkv, num_pages = pool.shape[:2]
    flat = pool.reshape(hkv * num_pages, *pool.shape[2:])
    at = jnp.arange(hkv)[:, None] * num_pages + pages[None, :]  # [Hkv, N]
    at = jnp.where(valid[None, :], at, flat.shape[0])  # invalid: past the end, dropped
    columns = slots[:, None] + jnp.arange(new.shape[2])  # [N, T]
    fresh = jnp.moveaxis(new, 1, 0)  # [Hkv, N, T, ...]
    flat = flat.at[at[:, :, None], columns[None]].set(fresh.astype(pool.dtype), mode='drop')
    return flat.reshape(pool.shape)


def _per_array(local, pool: Pool, new_k, new_v, *by_row) -> Pool:
    """The pool with local(k, v, k_scale, v_scale, new_k, new_v, *by_row) run on each of its
    arrays and those arrays' layers of new_k, new_v [L, ...]."""
    arrays = pool.arrays()
    layers = new_k.shape[0] // len(arrays)
    return Pool.of([_on_devices(local, a, new_k[i * layers:(i + 1) * layers],
                                new_v[i * layers:(i + 1) * layers], *by_row)
                    for i, a in enumerate(arrays)], pool.layout)


def _on_devices(local, arrays: tuple, new_k, new_v, *by_row) -> tuple:
    """local(k, v, k_scale, v_scale, new_k, new_v, *by_row) -> (k, v, k_scale, v_scale), run on
    each device's block of rows and its KV heads (shard_map) under a mesh: XLA's partitioner
    would otherwise gather every row's update to every device. `by_row` arrays have rows (or
    blocks) first; new_k and new_v have them second."""
    args = (*arrays, new_k, new_v, *by_row)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or 'tensor' not in mesh.axis_names:
        return local(*args)
    shape = dict(mesh.shape)
    rows = logical_spec(('batch',), by_row[0].shape[:1], shape)[0]
    heads = logical_spec(('kv_heads',), (arrays[0].shape[0],), shape)[0]
    pages_spec = P(heads, rows, None, None)
    scales = None if arrays[2] is None else P(heads, rows, None)
    new_spec = P(None, rows, None, heads, None)
    row_specs = tuple(P(rows, *(None,) * (x.ndim - 1)) for x in by_row)
    return jax.shard_map(local, in_specs=(pages_spec, pages_spec, scales, scales, new_spec,
                                          new_spec, *row_specs),
                         out_specs=(pages_spec, pages_spec, scales, scales),
                         check_vma=False)(*args)
