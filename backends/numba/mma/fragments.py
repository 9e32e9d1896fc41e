"""Warp-level fragments of the tensor-core kernels: the lanes' ldmatrix addresses (x4_address,
b_address) and the mma loops of every tensor-core kernel (scores, accumulate), which read at
such an address plus constant byte offsets (the accumulators' softmax, packing and stores are
device/fragments.py's, shared with the Hopper family).

A warp owns `slices` 16-row slices of its tile (the forward may take two, so that every K/V
fragment read from shared memory feeds two mma instructions; the backward takes one).
Accumulators are (slices, 8-column blocks, 4) float32 register arrays in mma's C layout.
Tiles are 16-bit patterns (uint16) carved out of the kernel's dynamic shared memory (so that
a config may use more than the 48 KiB a block gets without opting in), rows padded by
config.ROW_PAD halves.
"""
import functools

from numba import cuda, float32, uint32

from ..device.fragments import make_pack_chunk
from ..device.intrinsics import (ldmatrix_x4_at, ldmatrix_x4_trans_at, mma_bf16, mma_f16,
                                 opaque, shared_address)
from .config import MMA_SHARED_MEMORY_BYTES


WARP = 32


def check_shared_bytes(shared_bytes, what):
    if shared_bytes > MMA_SHARED_MEMORY_BYTES:
        raise ValueError(f"{what} needs {shared_bytes} bytes of shared memory; tensor-core "
                         f"configs may take at most {MMA_SHARED_MEMORY_BYTES}")


def check_rows_contiguous(**arrays):
    """The kernels' cp.async copies take each array's last dimension to be contiguous
    (cp_async_16); the engine copies other views first (marshal.is_tile_ready)."""
    for name, x in arrays.items():
        if x.strides[-1] != x.dtype.itemsize:
            raise ValueError(f"{name}: the last dimension must be contiguous; its stride is "
                             f"{x.strides[-1]} bytes")


@cuda.jit(device=True, inline="always")
def x4_address(tile, row0):
    """The lane's ldmatrix address for the 16x16 block of `tile` at rows row0.., column 0: as
    an A fragment (ldmatrix_x4_at), or as two B fragments of a [k][n] tile (.trans)."""
    lane = cuda.threadIdx.x % WARP
    return shared_address(tile, row0 + lane % 16, 8 * (lane // 16))


@cuda.jit(device=True, inline="always")
def b_address(tile, row0):
    """The lane's ldmatrix address for the B fragments of two 8-row blocks of an [n][k] tile
    (rows row0.., column 0), as K is stored for S = Q Kᵀ."""
    lane = cuda.threadIdx.x % WARP
    return shared_address(tile, row0 + lane % 8 + 8 * (lane // 16), 8 * ((lane // 8) % 2))


# The loops below read at a lane address (x4_address, b_address) plus constant byte offsets;
# the caller passes each address through intrinsics.opaque once per iteration of its own loop
# (see the comment above ldmatrix._LDMATRIX_AT: otherwise every read's address holds a
# register).

@functools.lru_cache(maxsize=None)
def make_warp_scores(bf16, slices, nb_count, kd_count, row_halves, a_in_registers=False):
    """scores(acc, a, b_at): for each of the warp's slices sl, acc[sl, nb, :] = A_sl Bᵀ, with
    A_sl the 16 x 16·kd_count block of slice sl and B the rows 8·nb.. of the block at b_at
    (b_address; B stored row = n, as K for S = Q Kᵀ); tiles have rows of row_halves halves.
    A is read at `a` (x4_address of the first slice; slice sl starts 16·sl rows further) or,
    with a_in_registers, taken from `a`, a (slices, kd_count, 4) array of A fragments."""
    mma = mma_bf16 if bf16 else mma_f16
    SLICE_BYTES = 2 * 16 * row_halves
    FRAGMENTS = (slices, 4)

    if a_in_registers:
        @cuda.jit(device=True, inline="always")
        def a_fragment(frag, a, sl, kd):
            for r in range(4):
                frag[sl, r] = a[sl, kd, r]
    else:
        @cuda.jit(device=True, inline="always")
        def a_fragment(frag, a, sl, kd):
            f = ldmatrix_x4_at(a, sl * SLICE_BYTES + 2 * 16 * kd)  # (2 bytes per half)
            for r in range(4):
                frag[sl, r] = f[r]

    @cuda.jit(device=True, inline="always")
    def scores(acc, a, b_at):
        frag = cuda.local.array(FRAGMENTS, uint32)
        for sl in range(slices):
            for nb in range(nb_count):
                for r in range(4):
                    acc[sl, nb, r] = float32(0.0)
        for kd in range(kd_count):
            for sl in range(slices):
                a_fragment(frag, a, sl, kd)
            for nb in range(0, nb_count, 2):  # one ldmatrix.x4 gives B for two 8-row blocks
                f = ldmatrix_x4_at(b_at, 2 * (8 * nb * row_halves + 16 * kd))
                for sl in range(slices):  # each B fragment feeds every slice of the warp
                    for half in range(2):
                        d = mma(frag[sl, 0], frag[sl, 1], frag[sl, 2], frag[sl, 3],
                                f[2 * half], f[2 * half + 1], acc[sl, nb + half, 0],
                                acc[sl, nb + half, 1], acc[sl, nb + half, 2],
                                acc[sl, nb + half, 3])
                        for r in range(4):
                            acc[sl, nb + half, r] = d[r]

    return scores


@functools.lru_cache(maxsize=None)
def make_q_scores(bf16, slices, nb_count, kd_count, row_halves, q_in_registers):
    """q_scores(s, q_frag, q_lane, k_at): make_warp_scores' S = Q Kᵀ with Q's A fragments
    taken from q_frag (q_in_registers) or read at q_lane (x4_address of the Q tile, passed
    through opaque here: see the comment above the loops)."""
    scores = make_warp_scores(bf16, slices, nb_count, kd_count, row_halves, q_in_registers)

    if q_in_registers:
        @cuda.jit(device=True, inline="always")
        def q_scores(s, q_frag, q_lane, k_at):
            scores(s, q_frag, k_at)
    else:
        @cuda.jit(device=True, inline="always")
        def q_scores(s, q_frag, q_lane, k_at):
            scores(s, opaque(q_lane), k_at)

    return q_scores


@functools.lru_cache(maxsize=None)
def make_warp_accumulate(bf16, slices, kc_count, db_count, row_halves):
    """accumulate(acc, p, b_at): acc[sl, db, :] += P_sl B for each of the warp's slices, with
    P_sl the 16 x 16·kc_count register tile p[sl, nb, :] (an accumulator of `scores`, packed
    here to 16 bits: the layout of two 8-column blocks is the A-fragment layout of a 16-wide
    chunk) and B the 16·kc_count x 8·db_count block at b_at (x4_address; B stored row = k, as
    V for O = P V)."""
    mma = mma_bf16 if bf16 else mma_f16
    pack_chunk = make_pack_chunk(bf16)
    FRAGMENTS = (slices, 4)

    @cuda.jit(device=True, inline="always")
    def pack_slice(a, p, sl, kc):
        a[sl, 0], a[sl, 1], a[sl, 2], a[sl, 3] = pack_chunk(p, sl, kc)

    @cuda.jit(device=True, inline="always")
    def accumulate(acc, p, b_at):
        a = cuda.local.array(FRAGMENTS, uint32)
        for kc in range(kc_count):
            if slices == 1:
                pack_slice(a, p, 0, kc)
            for db in range(0, db_count, 2):  # one ldmatrix.x4.trans gives B for two d-blocks
                f = ldmatrix_x4_trans_at(b_at, 2 * (16 * kc * row_halves + 8 * db))
                for sl in range(slices):  # each B fragment feeds every slice of the warp
                    if slices > 1:
                        # why: packed again for each B fragment, since holding every slice's
                        # packed P across the loop takes 4 registers a slice that the
                        # several-slice forward (254 registers at d128) does not have
                        pack_slice(a, p, sl, kc)
                    for half in range(2):
                        d = mma(a[sl, 0], a[sl, 1], a[sl, 2], a[sl, 3], f[2 * half],
                                f[2 * half + 1], acc[sl, db + half, 0], acc[sl, db + half, 1],
                                acc[sl, db + half, 2], acc[sl, db + half, 3])
                        for r in range(4):
                            acc[sl, db + half, r] = d[r]

    return accumulate
