"""Ring attention's plan: which attention calls one rank makes at one step of the ring.

The sequence of length S is cut into shards, one per rank of a ring of `world` ranks:
"contiguous" gives rank r the positions [r·S/world, (r+1)·S/world); "zigzag" cuts it into
2·world chunks and gives rank r chunks r and 2·world − 1 − r, so that under causal every rank
has as much work at every step. At step i a rank holds the key/value shard of rank
(r − i) mod world; each pair of (query segment, key segment) is a block of the global
attention matrix, and the global mask (causal, a window) restricted to that block is what
the call must apply.

numba_flash's windows are bottom-right aligned (query i sees key j iff i + nk − nq − left
<= j <= i + nk − nq + right), so a block whose global offset differs from its local one is
cut to the rows and keys that can see each other; its last query and last key then sit at a
distance the local window can express exactly (`block_call`). Pure Python: no torch.
"""
from typing import NamedTuple

LAYOUTS = ("zigzag", "contiguous")


class Segment(NamedTuple):
    """A run of consecutive global positions [start, start + length) held at rows
    [row, row + length) of a rank's shard."""
    start: int
    row: int
    length: int


class BlockCall(NamedTuple):
    """One attention call: query rows [q_begin, q_end) of the rank's shard against key rows
    [k_begin, k_end) of the key/value shard it holds, with the local window (left, right)
    (−1: unbounded; (−1, 0) is causal)."""
    q_begin: int
    q_end: int
    k_begin: int
    k_end: int
    window: tuple


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def shard_divisor(layout, world):
    """The sequence length must be a multiple of this to be sharded by `layout`."""
    return 2 * world if check_layout(layout) == "zigzag" else world


def segments(layout, rank, world, shard_len):
    """The segments of rank's shard of shard_len rows."""
    if check_layout(layout) == "contiguous":
        return (Segment(rank * shard_len, 0, shard_len),)
    chunk = shard_len // 2
    return (Segment(rank * chunk, 0, chunk), Segment((2 * world - 1 - rank) * chunk, chunk, chunk))


def block_call(q_seg, k_seg, left, right):
    """The call for the block (q_seg, k_seg) under the global window (left, right), or None
    when no query of q_seg sees a key of k_seg."""
    d = q_seg.start - k_seg.start  # query i sees key j iff i + d - left <= j <= i + d + right
    nq, nk = q_seg.length, k_seg.length
    i_lo, i_hi, j_lo, j_hi = 0, nq, 0, nk  # the rows and keys that see something
    if right >= 0:
        i_lo = max(i_lo, -d - right)
        j_hi = min(j_hi, nq - 1 + d + right + 1)
    if left >= 0:
        i_hi = min(i_hi, nk - 1 - d + left + 1)
        j_lo = max(j_lo, d - left)
    if right >= 0:
        j_hi = min(j_hi, i_hi - 1 + d + right + 1)
    if left >= 0:
        j_lo = max(j_lo, i_lo + d - left)
    if i_lo >= i_hi or j_lo >= j_hi:
        return None
    # The kernel aligns the last query with the last key: the window's sides move by the
    # global distance between them, end_gap (in [-right, left] after the cut above).
    end_gap = d + i_hi - j_hi
    rows, keys = i_hi - i_lo, j_hi - j_lo
    local_left = left - end_gap if left >= 0 else -1
    local_right = right + end_gap if right >= 0 else -1
    if local_left >= keys - 1:  # never binds: one spec for every full block
        local_left = -1
    if local_right >= rows - 1:
        local_right = -1
    return BlockCall(q_seg.row + i_lo, q_seg.row + i_hi, k_seg.row + j_lo, k_seg.row + j_hi,
                     (local_left, local_right))


def step_calls(layout, rank, source, world, shard_len, left, right):
    """The calls rank makes with the key/value shard of rank `source`, as few as the blocks
    allow: the diagonal step of causal or of no mask is one call (both shards map positions
    in the same increasing order, so causal on the shard is causal on the sequence; a wider
    window would see across the zigzag's gap), and unmasked blocks side by side become one
    call."""
    q_segs = segments(layout, rank, world, shard_len)
    if source == rank and left < 0 and right <= 0:
        return [BlockCall(0, shard_len, 0, shard_len, (-1, right))]
    k_segs = segments(layout, source, world, shard_len)
    calls = [call for q_seg in q_segs for k_seg in k_segs
             if (call := block_call(q_seg, k_seg, left, right)) is not None]
    return _join_unmasked(calls)


def _join_unmasked(calls):
    """Unmasked calls with the same key rows and adjacent query rows (or the same query rows
    and adjacent key rows) as one call."""
    joined = True
    while joined:
        joined = False
        for a in range(len(calls)):
            for b in range(len(calls)):
                one = _joined(calls[a], calls[b])
                if a != b and one is not None:
                    calls = [c for n, c in enumerate(calls) if n not in (a, b)] + [one]
                    joined = True
                    break
            if joined:
                break
    return sorted(calls)


def _joined(x, y):
    if x.window != (-1, -1) or y.window != (-1, -1):
        return None
    if (x.k_begin, x.k_end) == (y.k_begin, y.k_end) and x.q_end == y.q_begin:
        return BlockCall(x.q_begin, y.q_end, x.k_begin, x.k_end, (-1, -1))
    if (x.q_begin, x.q_end) == (y.q_begin, y.q_end) and x.k_end == y.k_begin:
        return BlockCall(x.q_begin, x.q_end, x.k_begin, y.k_end, (-1, -1))
    return None


def ring_plan(layout, rank, world, shard_len, left, right):
    """[(source, calls)] for steps 0 .. world − 1: at step i rank holds the key/value shard
    of source = (rank − i) mod world."""
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its length must be even; "
                         f"got {shard_len}")
    return [((rank - step) % world,
             step_calls(layout, rank, (rank - step) % world, world, shard_len, left, right))
            for step in range(world)]
