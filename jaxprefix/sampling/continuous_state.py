"""The continuous decode's state (continuous.py): its static sizes (Shape), where turns and
episodes end (Limits), the group slots (Groups), the rows (Rows), what it returns (Outputs),
the last step's tokens not yet in the pool (PendingTokens) and the whole loop carry
(LoopState), each array with a leading [D] axis of row-device blocks.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxprefix.models.paged_attention import PageLayout
from jaxprefix.models.sharding import constrain
from jaxprefix.sampling import page_pool

IDLE, QUEUED, ACTIVE, WAITING = 0, 1, 2, 3  # WAITING: its turn ended, the host answers it
SEGMENTS = ('prompt', 'suffix')  # a context's segments, as layout.py splits it
UNBOUNDED = 2 ** 30  # steps, rows or tokens: no bound


@dataclasses.dataclass(frozen=True)
class Shape:
    """The decode's static sizes, per block of rows (budget.plan chooses them): group slots of
    n rows, at most `row_slots` of them active, `admit` contexts prefilled together, up to
    `new_bucket` own tokens a row, `reserve` pages promised to each active row, and the rows'
    pages as `layout` says; `append_tokens` (turns) feeds a row's known tokens (the host's
    answer, a preempted row's replay) in passes of that many instead of one a step,
    `append_rows` rows a block at a time; `record_routes` (a MoE) records experts for routing
    replay. Hashable: the one static argument of the programs."""
    n: int
    new_bucket: int
    row_slots: int
    context_slots: int
    admit: int
    reserve: int
    layout: PageLayout
    append_tokens: int = 0  # known tokens a row feeds in one pass (0: one a decode step)
    append_rows: int = 1    # rows of a block a pass feeds
    record_routes: bool = False
    # Rows a decode step computes per block, the active ones first (0: every row): a chunk
    # whose caller knows no more rows can be in flight (turns.py) skips the idle ones.
    rows_computed: int = 0


@flax.struct.dataclass
class Limits:
    """Where a row's turn and its episode end (traced: other values do not recompile). A turn
    ends after a stop id or `turn_tokens` sampled tokens; the episode after `turns` turns or
    when its tokens (context included) reach `episode_tokens`. One turn of generate():
    (max_new_tokens, 1, no bound)."""
    turn_tokens: jax.Array     # int32 []
    turns: jax.Array           # int32 []
    episode_tokens: jax.Array  # int32 []

    @classmethod
    def one_turn(cls, max_new_tokens) -> Limits:
        return cls(jnp.asarray(max_new_tokens, jnp.int32), jnp.int32(1), jnp.int32(UNBOUNDED))


@flax.struct.dataclass
class Groups:
    """[D, K] each (lengths, first: [D, K, segments]). A slot is free when context is -1 (then
    none of its rows is queued or active)."""
    context: jax.Array        # int32: index of the context within its block
    stamp: jax.Array          # int32: admission order; older groups' queued rows start first
    last_token: jax.Array     # int32: the held-back last context token, every sample's first input
    last_position: jax.Array  # int32
    lengths: jax.Array        # int32: real tokens of each context segment (prompt, suffix)
    first: jax.Array          # int32: the position of each segment's first token


@flax.struct.dataclass
class Rows:
    """[D, K * n] each; row r of a block is sample r % n of the group in slot r // n. A row's
    own tokens are everything after its context: sampled turns and, between them, the tokens
    the host appended (observations); own token t is drawn at the step that feeds token t - 1."""
    state: jax.Array    # int32: IDLE (free slot or done), QUEUED, ACTIVE or WAITING
    t: jax.Array        # int32: own tokens drawn so far (its next own token's index)
    token: jax.Array    # int32: the token fed at the next step
    position: jax.Array  # int32: its position
    started: jax.Array  # int32: the loop step it (last) started at: preemption takes the youngest
    known: jax.Array    # int32: own tokens below this index are known (Outputs.completions):
                        # appended by the host, or drawn before a preemption: fed, not drawn
    replay: jax.Array   # int32: own tokens below this index were computed before a preemption
    turn: jax.Array     # int32: its turn (0 first)
    turn_start: jax.Array  # int32: the own index of its turn's first sampled token


@flax.struct.dataclass
class Outputs:
    """[D * R, T] and [D * R], R = contexts per block x n: row (d * C/D + m) * n + j is sample j
    of block d's context m, i.e. rows in request order."""
    completions: jax.Array  # int32: own tokens (sampled, and what the host appended)
    logprobs: jax.Array     # f32: of sampled tokens (0 elsewhere)
    lengths: jax.Array      # int32
    stopped: jax.Array      # bool: its last sampled token is a stop id
    waiting: jax.Array      # bool: its turn ended and the host has yet to answer
    recomputed: jax.Array   # int32: tokens before its current turn computed again (preempted)
    # record_routes: [D * R, T, sparse layers, k] as static.DecodeState.routes; the contexts'
    # (row: the context in request order) prompts' [C, Sp, ...] and suffixes' [C, Ss, ...]
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None
    suffix_routes: jax.Array | None = None


@flax.struct.dataclass
class PendingTokens:
    """The last step's new keys and values, written into the rows' pages at the top of the next
    step: then the pool's in-place write comes before that step's reads of it (written after
    the reads, nothing but the model's output orders them, and the K and V projections come
    before attention: XLA copied every layer's pool each step to keep the reads safe). A row
    still going then has the same page table and one token more (its own index t - 1)."""
    k: jax.Array        # [L, D * R, 1, Hkv, Dh]
    v: jax.Array
    valid: jax.Array    # bool [D * R]: rows still going (a stopped row's last token is not read)


@flax.struct.dataclass
class LoopState:
    step: jax.Array             # int32 []
    groups: Groups
    rows: Rows
    next_context: jax.Array     # int32 [D]: the block's next context to admit
    admitted: jax.Array         # int32 [D]: contexts admitted so far (the next stamp)
    store: tuple                # page_pool.Pools, one per context segment: the groups' contexts
    tables: page_pool.PageTables
    pool: page_pool.Pool        # the rows' own tokens
    pending: PendingTokens      # the last step's, not yet in the pool
    out: Outputs


def blocks(x: jax.Array, d: int) -> jax.Array:
    return x.reshape(d, x.shape[0] // d, *x.shape[1:])


def constrain_blocks(tree):
    """Every [D, ...] scheduling array split over the row devices."""
    return jax.tree.map(lambda x: constrain(x, ('batch',) + (None,) * (x.ndim - 1)), tree)
