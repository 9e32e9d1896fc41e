"""Which rows of the arrays a block's sequence is: the batch entry of a plain call, or one of
varlen's packed sequences.

Varlen arrays are seen by the kernels with a batch axis of one: q, k, v, out (1, total, nheads,
headdim), lse (1, nheads, total_q); grid.z runs over the sequences and cu_seqlens say where
each starts. A kernel then works in the sequence's own coordinates (m0, n0, seqlen_q,
seqlen_k: what the mask and block_range take) and adds q_start / k_start where it reads or
writes an array, whose row bound is q_start + seqlen_q (the loaders zero-fill past it and the
stores skip it, so a tile never touches the next sequence's rows). The Hopper kernels' copy
engine reads through maps of the sequence's own rows instead (hopper/tensor_maps.py), in the
sequence's coordinates.
"""
import functools

from numba import cuda


@functools.lru_cache(maxsize=None)
def make_sequence(spec):
    """sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k) -> (b, q_start, seqlen_q, k_start,
    seqlen_k) for the block's sequence `seq` (blockIdx.z): b indexes the arrays' batch axis,
    the rows of sequence seq are q_start.. q_start + seqlen_q - 1 (keys likewise)."""
    varlen = spec.varlen

    @cuda.jit(device=True, inline="always")
    def sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k):
        if varlen:  # (int: row indices in the arrays' index type, not int32)
            q_start, k_start = int(cu_seqlens_q[seq]), int(cu_seqlens_k[seq])
            return (0, q_start, int(cu_seqlens_q[seq + 1]) - q_start, k_start,
                    int(cu_seqlens_k[seq + 1]) - k_start)
        return seq, 0, q.shape[1], 0, k.shape[1]

    return sequence


def grid_extent(spec, x, cu_seqlens, side):
    """(rows, sequences) a launch's grid covers along q (side 0) or k (side 1) for the
    kernels' view x (batch, seqlen, nheads, headdim): varlen's max_seqlen and number of
    sequences, else x's seqlen and batch."""
    if spec.varlen:
        return (spec.max_seqlen_q, spec.max_seqlen_k)[side], int(cu_seqlens.shape[0]) - 1
    return int(x.shape[1]), int(x.shape[0])
