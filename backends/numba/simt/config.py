"""Tile configurations of the SIMT kernels: one frozen dataclass per kernel and one heuristic.

The SIMT kernels keep every tile in float32 whatever the input dtype, in dynamic shared memory:
each kernel's config is the first of its candidates that fits what the GPU gives a block (the
last fits 48 KiB, which every CUDA GPU gives). The measurements that ordered the candidates:
docs/KERNEL_NOTES.md, "Tuning history".
"""
from dataclasses import dataclass

from ..config_table import pick
from ..gpu import SHARED_MEMORY_BYTES


def simt_padded_head_dim(head_dim):
    """The SIMT kernels' output tile width: head_dim rounded up to whole 4-wide column chunks
    for each of a warp's 8 column groups."""
    return -(-head_dim // 32) * 32


@dataclass(frozen=True)
class SimtForwardConfig:
    """Tile shape of the SIMT forward: `warps` warps, each owning 4·rows_per_thread query rows
    of the tile; a warp's lanes form 4 row groups x 8 column groups, so a thread holds a
    rows_per_thread x keys_per_thread register tile of S (keys tx + 8·j) and of the output a
    rows_per_thread x head_dim/8 tile (columns in 4-wide chunks, (8·c + tx)·4 + e)."""

    warps: int
    rows_per_thread: int
    keys_per_thread: int

    def __post_init__(self):
        if min(self.warps, self.rows_per_thread, self.keys_per_thread) < 1:
            raise ValueError(f"{self}: every field must be >= 1")

    @property
    def block_m(self):
        return 4 * self.warps * self.rows_per_thread

    @property
    def block_n(self):
        return 8 * self.keys_per_thread

    @property
    def threads(self):
        return 32 * self.warps

    padded_head_dim = staticmethod(simt_padded_head_dim)


def simt_forward_shared_bytes(config, head_dim):
    """Dynamic shared memory of the SIMT forward: Q, K, V tiles (rows of the padded head dim
    + 4 floats) and the P tile (rows of block_n + 8 floats)."""
    row = config.padded_head_dim(head_dim) + 4
    return 4 * ((config.block_m + 2 * config.block_n) * row
                + config.block_m * (config.block_n + 8))


# Candidates per head dim, fastest first (H200, docs/KERNEL_NOTES.md "Tuning history");
# simt_forward_config takes the first that fits the GPU's shared memory per block.
_SIMT_FORWARD = (  # (max head_dim, candidates)
    (32, (SimtForwardConfig(4, 4, 8), SimtForwardConfig(2, 4, 8))),
    (64, (SimtForwardConfig(4, 8, 4), SimtForwardConfig(2, 8, 4))),
    (128, (SimtForwardConfig(4, 4, 4), SimtForwardConfig(4, 2, 4), SimtForwardConfig(2, 2, 4))),
    (256, (SimtForwardConfig(4, 2, 4), SimtForwardConfig(2, 2, 4), SimtForwardConfig(1, 2, 2))),
)


def simt_forward_candidates(head_dim):
    """The SIMT forward's configs for head_dim, fastest first."""
    return pick(_SIMT_FORWARD, head_dim)


def simt_forward_config(head_dim, shared_limit=SHARED_MEMORY_BYTES):
    """The SIMT forward's config for head_dim on a GPU that gives a block `shared_limit` bytes
    of shared memory."""
    for config in simt_forward_candidates(head_dim):
        if simt_forward_shared_bytes(config, head_dim) <= shared_limit:
            return config
    raise ValueError(f"no SIMT forward config for headdim {head_dim} fits {shared_limit} bytes "
                     f"of shared memory")


@dataclass(frozen=True)
class SimtBackwardConfig:
    """Tile shapes of the SIMT backward's two kernels, each laid out as the forward (warps own
    row bands of 4·rows_per_thread rows; lanes 4 row groups x 8 column groups).
    dk/dv: a block per key tile of 4·warps·key_rows keys, streaming query tiles of
    8·query_cols queries; dq: a block per query tile of 4·warps·query_rows queries, streaming
    key tiles of 8·key_cols keys. With stages = 2 the streamed tiles are double-buffered (the
    next tile's copy runs while this one is used); with 1, one buffer and a second barrier."""

    warps: int
    key_rows: int
    query_cols: int
    query_rows: int
    key_cols: int
    stages: int = 2

    def __post_init__(self):
        if min(self.warps, self.key_rows, self.query_cols, self.query_rows, self.key_cols) < 1:
            raise ValueError(f"{self}: every tile field must be >= 1")
        if self.stages not in (1, 2):
            raise ValueError(f"{self}: stages must be 1 or 2")

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def dk_dv_tiles(self):
        """(keys per block, queries per streamed tile) of the dk/dv kernel."""
        return 4 * self.warps * self.key_rows, 8 * self.query_cols

    @property
    def dq_tiles(self):
        """(queries per block, keys per streamed tile) of the dq kernel."""
        return 4 * self.warps * self.query_rows, 8 * self.key_cols

    padded_head_dim = staticmethod(simt_padded_head_dim)


def simt_backward_shared_bytes(config, head_dim):
    """(dk/dv kernel, dq kernel) dynamic shared memory of the SIMT backward: the block's two
    tiles (K, V or Q, dO), `stages` pairs of streamed tiles, the P and dS tiles (dq: dS only)
    and, for dk/dv, `stages` rows of lse and D values."""
    row = config.padded_head_dim(head_dim) + 4
    keys, queries = config.dk_dv_tiles
    dk_dv = ((2 * keys + 2 * config.stages * queries) * row + 2 * keys * (queries + 8)
             + 2 * config.stages * queries)
    queries, keys = config.dq_tiles
    dq = (2 * queries + 2 * config.stages * keys) * row + queries * (keys + 8)
    return 4 * dk_dv, 4 * dq


# Candidates per head dim, fastest first, as for the forward; the last of each fits 48 KiB.
_SIMT_BACKWARD = (  # (max head_dim, candidates)
    (64, (SimtBackwardConfig(4, 4, 4, 4, 4), SimtBackwardConfig(2, 2, 4, 4, 4, stages=1))),
    (128, (SimtBackwardConfig(4, 2, 4, 4, 4), SimtBackwardConfig(2, 4, 4, 4, 4, stages=1),
           SimtBackwardConfig(1, 2, 2, 2, 2, stages=1))),
    (256, (SimtBackwardConfig(4, 2, 4, 2, 4), SimtBackwardConfig(2, 1, 4, 1, 4, stages=1),
           SimtBackwardConfig(1, 1, 2, 1, 2, stages=1))),
)


def simt_backward_candidates(head_dim):
    """The SIMT backward's configs for head_dim, fastest first."""
    return pick(_SIMT_BACKWARD, head_dim)


def simt_backward_config(head_dim, shared_limit=SHARED_MEMORY_BYTES):
    """The SIMT backward's config for head_dim on a GPU that gives a block `shared_limit`
    bytes of shared memory."""
    for config in simt_backward_candidates(head_dim):
        if max(simt_backward_shared_bytes(config, head_dim)) <= shared_limit:
            return config
    raise ValueError(f"no SIMT backward config for headdim {head_dim} fits {shared_limit} "
                     f"bytes of shared memory")
