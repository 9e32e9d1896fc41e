"""Tile configurations of the tensor-core kernels: one frozen dataclass per kernel, one table
per kernel by head dim, and the head dim a call runs at (mma_head_dim)."""
from dataclasses import dataclass, replace

from ..config_table import lookup

#: Tensor-core kernels keep 16-bit tiles in dynamic shared memory, rows of head_dim halves padded
#: by ROW_PAD halves (16 bytes) so that the 8 row addresses of an ldmatrix start 4 banks apart.
ROW_PAD = 8
#: The most shared memory a tensor-core config may take (above 48 KiB a kernel opts in): what
#: sm_86 and sm_89 give one block. sm_80 gives 163 KiB and sm_90 227 KiB.
MMA_SHARED_MEMORY_BYTES = 99 * 1024


@dataclass(frozen=True)
class MmaConfig:
    """Tile shape of the tensor-core forward: `warps` warps of 16·slices query rows each, key
    tiles of block_n keys. With slices > 1 every K/V fragment a warp reads from shared memory
    feeds `slices` mma instructions, at the cost of slices× the S and O registers."""

    block_n: int
    warps: int
    slices: int = 1

    @property
    def block_m(self):
        return 16 * self.warps * self.slices


# Chosen by scripts/tune_mma.py on an H200 (docs/KERNEL_NOTES.md, "Tuning history"): the fastest
# candidate without spills for sm_80 and sm_90 that fits MMA_SHARED_MEMORY_BYTES. Head dims that
# are not multiples of 16 run padded (mma_head_dim).
_MMA_FORWARD = (
    (64, MmaConfig(block_n=32, warps=4, slices=2)),
    (128, MmaConfig(block_n=32, warps=4, slices=2)),
    (256, MmaConfig(block_n=16, warps=4, slices=1)),
)


def mma_forward_shared_bytes(config, head_dim):
    """Shared memory of the tensor-core forward: the Q tile and one K and one V tile."""
    return 2 * (config.block_m + 2 * config.block_n) * (head_dim + ROW_PAD)


def mma_forward_config(head_dim, spec=None):
    """The tensor-core forward's config for head_dim (and the call's spec), or None if it has
    none. A spec with an attn_mask or a mask_mod takes one 16-row slice per warp: reading
    the mask's elements in the score loop took the two-slice kernels past 255 registers
    (spills at d64 and d128 once softcap or ALiBi came with it; docs/KERNEL_NOTES.md,
    "Masks"; a mask_mod with every other variant spilled 132 bytes at d128)."""
    config = None if head_dim % 16 else lookup(_MMA_FORWARD, head_dim)
    if config is not None and spec is not None and (spec.attn_mask is not None
                                                    or spec.mask_mod is not None):
        config = replace(config, slices=1)
    return config


@dataclass(frozen=True)
class MmaBackwardConfig:
    """Tile shape of the tensor-core backward: `warps` warps of 16 rows (keys in dk/dv,
    queries in dq); dk/dv loops over query tiles of block_m, dq over key tiles of block_n.
    With stages = 2 each loop loads its next tile into a second buffer while it computes.
    With d_split = 2 each tile gets two blocks, each accumulating half of the head dim's
    columns (dK and dV of 16 keys x 256 columns would not fit in a warp's registers)."""

    block_m: int
    block_n: int
    warps: int
    stages: int = 1
    d_split: int = 1


# Chosen the same way (docs/KERNEL_NOTES.md, "Tuning history").
_MMA_BACKWARD = (
    (64, MmaBackwardConfig(block_m=32, block_n=64, warps=4, stages=2)),
    (128, MmaBackwardConfig(block_m=32, block_n=32, warps=4, stages=2)),
    # d256: split in two halves of the head dim, one stage (two would take more than
    # MMA_SHARED_MEMORY_BYTES at 4 warps)
    (256, MmaBackwardConfig(block_m=16, block_n=16, warps=4, stages=1, d_split=2)),
)


def mma_backward_shared_bytes(config, head_dim):
    """(dK/dV kernel, dQ kernel) shared memory of the tensor-core backward: K, V tiles of
    16·warps keys and, per stage, Q, dO tiles of block_m queries with their lse and D values;
    Q, dO tiles of 16·warps queries and, per stage, K, V tiles of block_n keys."""
    rows, row_bytes, stages = 16 * config.warps, 2 * (head_dim + ROW_PAD), config.stages
    dk_dv = 2 * (rows + stages * config.block_m) * row_bytes + 2 * 4 * stages * config.block_m
    dq = 2 * (rows + stages * config.block_n) * row_bytes
    return dk_dv, dq


#: a floating attn_mask beside softcap or ALiBi (spec given), head dims up to 64: at d64 the
#: dQ kernel's loop over 64-key tiles, the mask's read, the tanh and the slope in its body,
#: was not unrolled and kept S and dP in local memory (256 bytes, sm_80 and sm_90); 32-key
#: tiles unroll
_MMA_BACKWARD_BIASED = (
    (64, MmaBackwardConfig(block_m=32, block_n=32, warps=4, stages=2)),
)


def mma_backward_config(head_dim, spec=None):
    """The tensor-core backward's config for head_dim (and the call's spec, where it
    changes the tiles), or None if it has none (head_dim must split into d_split parts of a
    multiple of 16 columns)."""
    config = None if head_dim % 16 else lookup(_MMA_BACKWARD, head_dim)
    biased = spec is not None and spec.float_mask and (spec.softcap or spec.alibi)
    if config is not None and biased:
        config = lookup(_MMA_BACKWARD_BIASED, head_dim) or config
    return None if config is None or head_dim % (16 * config.d_split) else config


def mma_head_dim(head_dim):
    """The head dim the tensor-core kernels run head_dim at (the next multiple of 16 for which
    the forward and the backward have a config: of 32 above 128, where the backward splits the
    head dim in two), or None if there is none."""
    for padded in range(-(-head_dim // 16) * 16, head_dim + 32, 16):
        if mma_forward_config(padded) and mma_backward_config(padded):
            return padded
    return None
