"""How the blocks are laid on their grids when they are few.

A dK/dV block owns a key tile of one key/value head and walks the query tiles of every query
head of its GQA group, so a call has key tiles × kv heads × batch blocks: at batch 1 with GQA
(a training step, a long prompt) fewer than the GPU has multiprocessors, one block each.
And under causal the tiles' blocks differ in length (the dK/dV block of key tile 0 and the dQ
block of the last query tile visit every tile of the other side, the opposite ends one),
while the GPU starts blocks in grid order, tiles fastest: each head's long blocks come
after the previous head's short ones, and the grid ends on long blocks. Two remedies:

- a group split: each dK/dV block walks group / split of the group's heads and writes its dK
  and dV (float32) to a head slot of its own; a second kernel (device/group_sums.py) adds a
  key head's slots in a fixed order and rounds once, so the result does not depend on which
  block ran first (the backward stays deterministic);
- tiles slowest: tiles along grid.y and heads (slots) along grid.x, so that blocks start
  longest first across heads. The forward's query tiles too: its last tiles see the most keys.

Both cost something where blocks are many (the sums' traffic; blocks running together over
more heads' tiles than L2 keeps near: a longest-first order over sections of heads lost
1-8 % at four and more waves), so a grid of several waves keeps its plain layout.
"""
from dataclasses import dataclass

#: grids of at most this many waves (blocks per multiprocessor) start longest first under causal
LONGEST_FIRST_WAVES = 4


@dataclass(frozen=True)
class BackwardGrid:
    """`split`: the dK/dV blocks of one key tile and key head (group / split query heads
    each; 1: one block walks the whole group and stores dK and dV itself); `keys_slowest`:
    dK/dV's key tiles along grid.y; `queries_slowest`: dQ's query tiles along grid.y."""

    split: int = 1
    keys_slowest: bool = False
    queries_slowest: bool = False


def backward_grid(spec, key_tiles, kv_heads, query_tiles, nheads, batch, multiprocessors):
    """The layout of a call's two grids (key_tiles × kv_heads × batch dK/dV blocks,
    query_tiles × nheads × batch dQ blocks; one block per multiprocessor). Under causal,
    where the dK/dV blocks do not fill the GPU, the smallest split of the group that fills it
    (the long blocks get shorter, the short ones fill the rest); else the largest split that
    keeps one wave (whole waves of shorter blocks take as long). Tiles slowest under causal
    within LONGEST_FIRST_WAVES."""
    blocks = key_tiles * kv_heads * batch
    split = 1
    if 0 < blocks < multiprocessors:
        for parts in range(2, spec.group + 1):
            if spec.group % parts:
                continue
            if not spec.causal and blocks * parts > multiprocessors:
                break
            split = parts
            if blocks * parts >= multiprocessors:
                break
    return BackwardGrid(split, tiles_slowest(spec, blocks * split, multiprocessors),
                        tiles_slowest(spec, query_tiles * nheads * batch, multiprocessors))


def tiles_slowest(spec, blocks, multiprocessors):
    """Whether a grid of `blocks` blocks (one per multiprocessor) lays its tiles along grid.y:
    under causal, within LONGEST_FIRST_WAVES."""
    return spec.causal and blocks <= LONGEST_FIRST_WAVES * multiprocessors


def grid_shape(tiles, heads, batch, slowest):
    """The launch grid of tiles × heads × batch blocks: the tiles along grid.x, or with
    `slowest` along grid.y (heads along x)."""
    return (heads, tiles, batch) if slowest else (tiles, heads, batch)
