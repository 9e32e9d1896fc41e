"""The tile tables of a call with a mask_mod (device/mask_mod.py reads them): for a kernel's
tile shape, each (query tile, key tile) classified EMPTY, PARTIAL or FULL by mask_mod alone,
and per tile the span of tiles along the other axis that are not empty. A tile that causal or
the window hides wholly (block_range's EMPTY: no kernel visits it) is EMPTY without asking
mask_mod, so the tables are per window; a mask_mod whose code never reads b (or h) gets one
table for every batch entry (head), except that varlen's sequences each get their own.

Two small kernels build them on the call's stream before the attention kernels run:
`classify`, one block per (query tile, key tile, batch entry · head) (under the simulator
one per batch entry · head, looping over the tiles), whose threads evaluate
mask_mod on a strided share of the tile's elements inside the bounds and combine "some query
sees some key" and "every query sees every key" with syncthreads_or / syncthreads_and; and
`spans`, one thread per (batch entry, head, tile) scanning its row or column of classes (for
the dK/dV kernels per key/value head, over the query heads of its GQA group). A BlockMask
(numba_flash.block_mask) keeps the tables per device, tile shape, group and window; a call
without one builds them for its own batch and heads and lets them go with it. Their stand-ins
(TileTableStandIns) give a kernel's argument types before its tables are built.
"""
import functools

import numpy as np
from numba import cuda

from numba_flash.block_mask import BlockMask

from . import marshal, replay
from .device.block_range import EMPTY, FULL, PARTIAL, make_block_range
from .device.mask_mod import make_mask_mod_reader
from .gpu import simulator_enabled
from .launch import (DeviceView, contiguous_strides, current_device, kernel_extras_unused,
                     launch)

THREADS = 128
#: the element types of a tile shape's classes, query spans and key spans
TABLE_DTYPES = ("int8", "int32", "int32")
#: under the simulator, which runs a Python thread per GPU thread: fewer, each doing more
SIMULATOR_THREADS = 1


@functools.lru_cache(maxsize=None)
def _classify_kernel(spec, block_m, block_n, threads):
    mod_allows = make_mask_mod_reader(spec)
    tile_class = make_block_range(spec, block_m, block_n)[2]
    varlen = spec.varlen

    def classify(classes, sizes, cu_seqlens_q, cu_seqlens_k, mod_arrays):
        nheads = classes.shape[1]
        b, h = cuda.blockIdx.z // nheads, cuda.blockIdx.z % nheads
        seqlen_q, seqlen_k = sizes[0], sizes[1]
        if varlen:
            seqlen_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
            seqlen_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        n_tiles = classes.shape[3]
        for tile in range(cuda.blockIdx.x, classes.shape[2] * n_tiles, cuda.gridDim.x):
            m0, n0 = tile // n_tiles * block_m, tile % n_tiles * block_n
            if tile_class(m0, n0, seqlen_q, seqlen_k) == EMPTY:  # (no kernel visits it)
                if cuda.threadIdx.x == 0:
                    classes[b, h, tile // n_tiles, tile % n_tiles] = EMPTY
                continue
            some, every = False, True
            for e in range(cuda.threadIdx.x, block_m * block_n, threads):
                row, col = m0 + e // block_n, n0 + e % block_n
                if row < seqlen_q and col < seqlen_k:
                    seen = mod_allows((classes, b, h, mod_arrays), row, col, seqlen_q,
                                      seqlen_k)
                    some = some or seen
                    every = every and seen
            some = cuda.syncthreads_or(1 if some else 0) != 0
            every = cuda.syncthreads_and(1 if every else 0) != 0
            if cuda.threadIdx.x == 0:
                classes[b, h, tile // n_tiles, tile % n_tiles] = (
                    EMPTY if not some else FULL if every else PARTIAL)

    return cuda.jit(classify)  # (no disk cache: the key would not see mask_mod's code)


@cuda.jit(cache=True)
def _spans_kernel(classes, query_spans, key_spans, sizes):
    """query_spans[b, h, m] = [first, last + 1) key tiles of query tile m that are not
    empty ((0, 0): none); key_spans[b, h_kv, n] likewise over the query tiles of the heads
    h_kv·group .. h_kv·group + group - 1 (group = sizes[2]; one head where classes has
    one)."""
    group = sizes[2]
    batch, nheads, m_tiles, n_tiles = classes.shape
    kv_heads = key_spans.shape[1]
    rows = batch * nheads * m_tiles
    for i in range(cuda.grid(1), rows + batch * kv_heads * n_tiles, cuda.gridsize(1)):
        first, end = -1, 0
        if i < rows:
            b, h, m = i // (nheads * m_tiles), i // m_tiles % nheads, i % m_tiles
            for n in range(n_tiles):
                if classes[b, h, m, n] != EMPTY:
                    first = n if first < 0 else first
                    end = n + 1
            query_spans[b, h, m, 0] = max(first, 0)
            query_spans[b, h, m, 1] = end
        else:
            j = i - rows
            b, h_kv, n = j // (kv_heads * n_tiles), j // n_tiles % kv_heads, j % n_tiles
            heads = group if nheads > 1 else 1
            for head in range(h_kv * heads, h_kv * heads + heads):
                for m in range(m_tiles):
                    if classes[b, head, m, n] != EMPTY:
                        first = m if first < 0 or m < first else first
                        end = max(end, m + 1)
            key_spans[b, h_kv, n, 0] = max(first, 0)
            key_spans[b, h_kv, n, 1] = end


class TileTables:
    """The tile tables of one call with a mask_mod, made on first use per tile shape.

    block_mask: the call's BlockMask, or None (the call's own, dropped after it); sizes:
    (batch, nheads, seqlen_q, seqlen_k) of the call (varlen: sequences, nheads, and the
    longest lengths, with the kernels' views of cu_seqlens); mod_arrays: the kernels' views
    of the arrays mask_mod captures (numba_flash/mask_mod.py), a tuple."""

    def __init__(self, spec, block_mask, sizes, alloc, stream, device, mod_arrays,
                 cu_seqlens=None):
        batch, nheads, seqlen_q, seqlen_k = sizes
        self.spec, self.sizes, self.alloc, self.stream = spec, sizes, alloc, stream
        self.block_mask = block_mask or BlockMask(spec.mask_mod.function, batch, nheads,
                                                  seqlen_q, seqlen_k)
        self.mod_arrays = mod_arrays
        self.device, self.cu_seqlens = device, cu_seqlens
        self.kept = block_mask is not None  # (then synchronised after building: see build)

    def arguments(self, block_m, block_n, along_keys):
        """(classes, spans, mod_arrays) for a kernel of block_m x block_n tiles: spans per
        query tile, or per key tile of a key/value head (along_keys: the dK/dV kernels)."""
        spec = self.spec
        tables = self.block_mask.tables((self.device, block_m, block_n, spec.group,
                                         spec.window_left, spec.window_right),
                                        functools.partial(self._build, block_m, block_n))
        classes, query_spans, key_spans, _ = tables
        spans = key_spans if along_keys else query_spans
        if self.kept:  # (the same tables for every call with this block mask)
            replay.note_constant(classes)
            replay.note_constant(spans)
        return self._views(marshal.view(classes), marshal.view(spans), along_keys)

    def stand_ins(self):
        """These tables as TileTableStandIns: arguments() of their types, nothing built."""
        return TileTableStandIns(self)

    def _views(self, classes_view, spans_view, along_keys):
        """The kernels' arguments from views of the classes and the spans: each broadcast to
        the call's batch and heads (the key/value heads' along keys)."""
        batch, nheads, _, _ = self.sizes
        heads = nheads // self.spec.group if along_keys else nheads
        return (marshal.broadcast(classes_view, (batch, nheads) + classes_view.shape[2:]),
                marshal.broadcast(spans_view, (batch, heads) + spans_view.shape[2:]),
                self.mod_arrays)

    def _shapes(self, block_m, block_n):
        """The shapes of (classes, query spans, key spans) for block_m x block_n tiles (of
        TABLE_DTYPES): per batch entry and head of the block mask (one where it has None, or
        where mask_mod reads no b or h; varlen: per sequence, whose lengths differ)."""
        mask, program = self.block_mask, self.spec.mask_mod
        per_sequence = program.reads_batch or self.cu_seqlens is not None
        batch = (mask.batch or 1) if per_sequence else 1
        nheads = (mask.nheads or 1) if program.reads_head else 1
        _, _, seqlen_q, seqlen_k = self.sizes
        m_tiles, n_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
        kv_heads = nheads // self.spec.group if nheads > 1 else 1
        return ((batch, nheads, m_tiles, n_tiles), (batch, nheads, m_tiles, 2),
                (batch, kv_heads, n_tiles, 2))

    def _build(self, block_m, block_n):
        if not self.kept:
            return self._classify(block_m, block_n)
        with replay.recording():  # (built once: a replay of a later call does not repeat it)
            tables = self._classify(block_m, block_n)
        cuda.synchronize()  # (kept for other calls, maybe on other streams)
        return tables

    def _classify(self, block_m, block_n):
        shapes = self._shapes(block_m, block_n)
        classes, query_spans, key_spans = (self.alloc(shape, dtype)
                                           for shape, dtype in zip(shapes, TABLE_DTYPES))
        batch, nheads, m_tiles, n_tiles = shapes[0]
        kv_heads = shapes[2][1]
        _, _, seqlen_q, seqlen_k = self.sizes
        sizes = np.array([seqlen_q, seqlen_k, self.spec.group], np.int32)
        if not simulator_enabled():
            sizes = cuda.to_device(sizes)
            replay.note_constant(sizes)  # (the signature's sizes)
        classes_view = marshal.view(classes)
        unused = kernel_extras_unused(classes_view)[0]
        cu_q, cu_k = self.cu_seqlens or (unused, unused)
        threads = SIMULATOR_THREADS if simulator_enabled() else THREADS
        tile_blocks = 1 if simulator_enabled() else m_tiles * n_tiles
        launch(_classify_kernel(self.spec.for_kernels(), block_m, block_n, threads),
               (tile_blocks, 1, batch * nheads), threads, self.stream, 0, classes_view,
               sizes, cu_q, cu_k, self.mod_arrays)
        spans = [marshal.view(query_spans), marshal.view(key_spans)]
        total = batch * (nheads * m_tiles + kv_heads * n_tiles)
        blocks = 1 if simulator_enabled() else -(-total // THREADS)
        launch(_spans_kernel, blocks, threads, self.stream, 0, classes_view, *spans, sizes)
        return classes, query_spans, key_spans, sizes  # (sizes: alive while the kernels run)


class TileTableStandIns:
    """A TileTables' arguments() as views of its tables' shapes and types at address 0, built
    for no tile shape: the types a kernel is compiled for, asked before its tables are built
    (hopper/key_tiles.py)."""

    def __init__(self, tables):
        self.tables = tables

    def arguments(self, block_m, block_n, along_keys):
        classes, query_spans, key_spans = (
            DeviceView(0, shape, contiguous_strides(shape, np.dtype(dtype).itemsize), dtype)
            for shape, dtype in zip(self.tables._shapes(block_m, block_n), TABLE_DTYPES))
        return self.tables._views(classes, key_spans if along_keys else query_spans,
                                  along_keys)


def tile_arguments(tiles, unused, block_m, block_n, along_keys=False):
    """The attention kernels' three last arguments: a mask_mod's (classes, spans, captured
    arrays) for this tile shape, or (`unused` twice (kernel_extras_unused), ()) without a
    mask_mod."""
    if tiles is None:
        unused = kernel_extras_unused(unused)[0]
        return unused, unused, ()
    return tiles.arguments(block_m, block_n, along_keys)


def call_tiles(spec, extras, kernel_extras, q_view, k_view, alloc, stream):
    """The TileTables of a call with a mask_mod (None for others): extras its
    numba_flash.extras.Extras (for the block mask), kernel_extras marshal.kernel_extras'
    views (for varlen's cu_seqlens), q_view and k_view the kernels' views of q and k."""
    if spec.mask_mod is None:
        return None
    nheads = int(q_view.shape[2])
    if spec.varlen:
        sizes = (int(kernel_extras[1].shape[0]) - 1, nheads, spec.max_seqlen_q,
                 spec.max_seqlen_k)
        cu_seqlens = kernel_extras[1:3]
    else:
        sizes = (int(q_view.shape[0]), nheads, int(q_view.shape[1]), int(k_view.shape[1]))
        cu_seqlens = None
    device = 0 if simulator_enabled() else current_device()
    mod_arrays = tuple(marshal.view(x) for x in extras.mask_mod_arrays)
    return TileTables(spec, extras.block_mask, sizes, alloc, stream, device, mod_arrays,
                      cu_seqlens)


def check_mask_mod(program, captured):
    """TypeError naming mask_mod unless Numba compiles its MaskModProgram for int64 indices
    and the captured arrays to a boolean (under the simulator: unless a call at index 0
    returns a boolean), before any launch. Numba's message is cut to its first lines."""
    if simulator_enabled():
        _check_at_zero(program, [marshal.view(x) for x in captured])
        return
    from .launch import _array_signature
    views = [marshal.view(x) for x in captured]
    _check_compiles(program, tuple(_array_signature(x.dtype, x.shape, x.strides)[0]
                                   for x in views))


def _check_at_zero(program, captured):
    name = program.name
    try:
        value = program.function(0, 0, 0, 0, *captured)
    except Exception as error:
        raise TypeError(f"mask_mod {name!r} failed at index (0, 0, 0, 0): "
                        f"{type(error).__name__}: {error}") from None
    try:  # (a bool, or a NumPy or torch boolean of one element, as a captured array gives)
        array = np.asarray(value)
        boolean = array.dtype == np.bool_ and array.size == 1
    except (TypeError, ValueError, RuntimeError):
        boolean = False
    if not boolean:
        raise TypeError(f"mask_mod {name!r} must return a bool; it returned "
                        f"{type(value).__name__}")


@functools.lru_cache(maxsize=64)
def _check_compiles(program, array_types):
    from numba import int64
    name = program.name
    try:
        _, returned = cuda.compile_ptx(program.function, (int64,) * 4 + array_types,
                                       device=True, cc=(8, 0))
    except Exception as error:
        lines = [line for line in str(error).splitlines() if line.strip()
                 and not line.startswith(("Failed in", "During:", "File "))]
        raise TypeError(f"mask_mod {name!r} does not compile for the Numba kernels: "
                        f"{' '.join(lines[:3])[:400]}") from None
    if str(returned) != "bool":
        raise TypeError(f"mask_mod {name!r} must return a bool; for int64 indices it returns "
                        f"{returned}")
