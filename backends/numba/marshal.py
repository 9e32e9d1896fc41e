"""The kernels' views of the caller's arrays, and the copies made where a kernel cannot read
an array in place.

A kernel takes a DeviceView (launch.py) of each array on the GPU, or a NumPy array under the
simulator; 16-bit data as its bit patterns (uint16) where the kernels decode them. cp.async
reads rows of 16-byte aligned, contiguous elements: an input that is not like that (a strided
view, a head dim the tensor-core kernels pad) is copied first into an aligned, zero-padded
buffer by copy_padded, and an output the kernels cannot write in place is computed into one
and copied back.
"""
import numpy as np
from numba import cuda

from numba_flash import _arrays

from .gpu import simulator_enabled
from .launch import DeviceView, device_view, kernel_extras_unused, launch

THREADS = 256
MAX_BLOCKS = 4096  # grid-stride beyond this: enough blocks to fill any current GPU


def view(x, bits=False):
    """The kernels' view of x, sharing its memory: a DeviceView on the GPU, a NumPy array
    under the simulator; with bits=True, its 16-bit patterns as uint16."""
    if _arrays.library(x) == "torch":
        x = x.detach()
        if bits:
            import torch
            x = x.view(torch.int16)  # NumPy has no bfloat16
    if simulator_enabled():  # the simulator copies its arguments, so only whole buffers
        result = np.ascontiguousarray(_arrays.as_numpy(x))
    else:
        result = device_view(x)
    return result.view(np.uint16) if bits else result


def kernel_extras(spec, extras, q_view, k_view, unused):
    """The attention kernels' (alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_mask)
    arguments: views of the call's numba_flash.extras.Extras, and `unused` where the spec has
    none. The slopes are seen as (sequences, nheads): a (nheads,) array through a batch
    stride of 0; the mask as (batch, nheads, seqlen_q, seqlen_k) through strides of 0 where
    it broadcasts, bfloat16 as its bits (device/attn_mask.py). (The simulator, which
    takes whole buffers, gets copies.)"""
    unused = kernel_extras_unused(unused)[0]
    if not (spec.alibi or spec.varlen or spec.attn_mask):
        return unused, unused, unused, unused
    cu_q, cu_k = ((view(extras.cu_seqlens_q), view(extras.cu_seqlens_k)) if spec.varlen
                  else (unused, unused))
    batch = int(cu_q.shape[0]) - 1 if spec.varlen else int(q_view.shape[0])
    slopes = unused
    if spec.alibi:
        slopes = broadcast(view(extras.alibi_slopes), (batch, int(q_view.shape[2])))
    attn_mask = unused
    if spec.attn_mask:
        shape = (batch, int(q_view.shape[2]), int(q_view.shape[1]), int(k_view.shape[1]))
        attn_mask = broadcast(view(extras.attn_mask, bits=spec.attn_mask == "bfloat16"), shape)
    return slopes, cu_q, cu_k, attn_mask


def broadcast(x_view, shape):
    """x's view broadcast to `shape` (NumPy's rule: missing leading dimensions and dimensions
    of 1 repeat): on the GPU through strides of 0, nothing copied; under the simulator a
    contiguous, writeable copy (it copies its arguments in and back, whole)."""
    if not isinstance(x_view, DeviceView):
        return np.array(np.broadcast_to(x_view, shape), order="C")
    lead = len(shape) - x_view.ndim
    strides = [0] * lead + [0 if n == 1 else stride
                            for n, stride in zip(x_view.shape, x_view.strides)]
    return DeviceView(x_view.ptr, shape, strides, x_view.dtype, x_view.owner)


def is_tile_ready(x_view, head_dim):
    """True if cp.async can copy this view's rows: head_dim columns, unit stride along them
    and every row starting 16-byte aligned (cp.async copies 16 B)."""
    if int(x_view.shape[3]) != head_dim or int(x_view.strides[3]) != x_view.dtype.itemsize:
        return False
    pointer = x_view.ptr if isinstance(x_view, DeviceView) else x_view.ctypes.data
    return pointer % 16 == 0 and all(int(s) % 16 == 0 for s in x_view.strides[:3])


def tile_ready_input(x, alloc, head_dim, stream, bits=False):
    """x's view (with bits, of its 16-bit patterns) if cp.async can read it in place, else an
    aligned copy, zero-padded to head_dim columns. alloc(shape, dtype) makes the copy's
    array (of the call's library and device)."""
    x_view = view(x, bits=bits)
    if is_tile_ready(x_view, head_dim):
        return x_view
    shape = tuple(int(s) for s in x.shape[:3]) + (head_dim,)
    copy = view(alloc(shape, "int16" if bits else x_view.dtype.name), bits=bits)
    copy_padded(x_view, copy, stream)
    return copy


def tile_ready_output(x, alloc, head_dim):
    """(kernel view, the view of x to copy it into afterwards, or None) for a 16-bit output:
    x's own view where the kernels can write it in place."""
    x_view = view(x, bits=True)
    if is_tile_ready(x_view, head_dim):
        return x_view, None
    shape = tuple(int(s) for s in x.shape[:3]) + (head_dim,)
    return view(alloc(shape, "int16"), bits=True), x_view


@cuda.jit(cache=True)
def _copy_padded_kernel(src, dst):
    batch, seqlen, nheads, width = dst.shape
    src_width = src.shape[3]
    for i in range(cuda.grid(1), batch * seqlen * nheads * width, cuda.gridsize(1)):
        d = i % width
        row = i // width
        h = row % nheads
        n = (row // nheads) % seqlen
        b = row // (nheads * seqlen)
        dst[b, n, h, d] = src[b, n, h, d] if d < src_width else 0


def copy_padded(src, dst, stream=0):
    """dst[..., :w] = src[..., :w] with w = min(widths), and dst[..., w:] = 0, on `stream`:
    (batch, seqlen, nheads, width) arrays of two head widths."""
    if simulator_enabled():  # NumPy views: a per-element simulated kernel would only be slower
        width = min(src.shape[3], dst.shape[3])
        dst[..., :width] = src[..., :width]
        dst[..., width:] = 0
        return
    total = dst.size
    if total:
        blocks = min(-(-total // THREADS), MAX_BLOCKS)
        launch(_copy_padded_kernel, blocks, THREADS, stream, 0, src, dst)
