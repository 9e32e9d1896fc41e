"""Tile configurations for the Numba kernels: one frozen dataclass and one heuristic per kernel.

The SIMT kernels keep every tile in float32 whatever the input dtype, in dynamic shared memory:
each kernel's config is the first of its candidates that fits what the GPU gives a block (the
last fits 48 KiB, which every CUDA GPU gives). The tensor-core kernels keep 16-bit tiles in
dynamic shared memory, up to MMA_SHARED_MEMORY_BYTES.
"""
from dataclasses import dataclass

SHARED_MEMORY_BYTES = 48 * 1024


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


# Candidates per head dim, fastest first; simt_forward_config takes the first that fits the
# GPU's shared memory per block (the last of each fits 48 KiB, which every CUDA GPU gives).
# From scripts/tune_simt.py on an H200, N = 4096, float32, cp.async loads, TFLOP/s full /
# causal (docs/tune_simt_2026-11-30b.log; plain loads in docs/tune_simt_2026-11-30.log):
# d32 (4, 4, 8) 31.2 / 27.8, (2, 4, 8) 29.1 / 28.0, (4, 8, 8) 26.5 / 25.2;
# d64 (4, 8, 4) 34.9 / 32.7, (2, 8, 4) 34.5 / 31.8, (4, 4, 4) 33.1 / 31.9, (4, 4, 8) 32.2 / 31.7;
# d128 (4, 4, 4) 30.1 / 29.0, (8, 4, 4) 30.4 / 28.7 (119 KiB), (4, 2, 4) 24.5 / 23.3,
# (2, 2, 4) 18.1 / 18.3; 8 rows per thread do not pay (docs/tune_simt_2026-12-01.log; 248-255
# registers, as (4, 4, 4)'s 254): (4, 8, 2) 30.9 / 27.6, (2, 8, 4) 25.5 / 21.0;
# d256 (4, 2, 4) 20.8 / 20.6, (2, 2, 4) 14.0 / 13.1, (1, 2, 2) 12.4 / 10.4. With plain loads
# (sm_75 and older, float16, head dims not a multiple of 4) the same configs come first:
# d64 (4, 8, 4) 16.9, d128 (4, 4, 4) 10.3.
_SIMT_FORWARD = (  # (max head_dim, candidates)
    (32, (SimtForwardConfig(4, 4, 8), SimtForwardConfig(2, 4, 8))),
    (64, (SimtForwardConfig(4, 8, 4), SimtForwardConfig(2, 8, 4))),
    (128, (SimtForwardConfig(4, 4, 4), SimtForwardConfig(4, 2, 4), SimtForwardConfig(2, 2, 4))),
    (256, (SimtForwardConfig(4, 2, 4), SimtForwardConfig(2, 2, 4), SimtForwardConfig(1, 2, 2))),
)


def simt_forward_candidates(head_dim):
    """The SIMT forward's configs for head_dim, fastest first."""
    return _pick(_SIMT_FORWARD, head_dim)


def simt_forward_config(head_dim, shared_limit=SHARED_MEMORY_BYTES):
    """The SIMT forward's config for head_dim on a GPU that gives a block `shared_limit` bytes
    of shared memory."""
    for config in simt_forward_candidates(head_dim):
        if simt_forward_shared_bytes(config, head_dim) <= shared_limit:
            return config
    raise ValueError(f"no SIMT forward config for headdim {head_dim} fits {shared_limit} bytes "
                     f"of shared memory")


def _lookup(table, head_dim):
    """The config of the first row of (max head_dim, config) that covers head_dim, or None."""
    for max_head_dim, config in table:
        if head_dim <= max_head_dim:
            return config
    return None


def _pick(table, head_dim):
    config = _lookup(table, head_dim)
    if config is None:
        raise ValueError(f"headdim must be <= {table[-1][0]}; got {head_dim}")
    return config


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
# From scripts/tune_simt.py --passes bwd on an H200, N = 4096, float32, full, cp.async loads
# (docs/tune_simt_bwd_2026-11-30.log, backward alone): d64 (4, 4, 4, 4, 4) 20.2 TFLOP/s, tied
# with (4, 4, 4, 8, 4) (122 KiB) and taken for fitting 99 KiB, (2, 2, 4, 4, 4, 1 stage) 17.8;
# d128 (4, 2, 4, 4, 4) 16.2 (142 KiB), (2, 4, 4, 4, 4, 1 stage) 15.9 (76 KiB),
# (1, 2, 2, 2, 2, 1 stage) 11.3. d32 and d256 are reasoned from those, not yet timed.
_SIMT_BACKWARD = (  # (max head_dim, candidates)
    (64, (SimtBackwardConfig(4, 4, 4, 4, 4), SimtBackwardConfig(2, 2, 4, 4, 4, stages=1))),
    (128, (SimtBackwardConfig(4, 2, 4, 4, 4), SimtBackwardConfig(2, 4, 4, 4, 4, stages=1),
           SimtBackwardConfig(1, 2, 2, 2, 2, stages=1))),
    (256, (SimtBackwardConfig(4, 2, 4, 2, 4), SimtBackwardConfig(2, 1, 4, 1, 4, stages=1),
           SimtBackwardConfig(1, 1, 2, 1, 2, stages=1))),
)


def simt_backward_candidates(head_dim):
    """The SIMT backward's configs for head_dim, fastest first."""
    return _pick(_SIMT_BACKWARD, head_dim)


def simt_backward_config(head_dim, shared_limit=SHARED_MEMORY_BYTES):
    """The SIMT backward's config for head_dim on a GPU that gives a block `shared_limit`
    bytes of shared memory."""
    for config in simt_backward_candidates(head_dim):
        if max(simt_backward_shared_bytes(config, head_dim)) <= shared_limit:
            return config
    raise ValueError(f"no SIMT backward config for headdim {head_dim} fits {shared_limit} "
                     f"bytes of shared memory")


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


# Chosen by scripts/tune_mma.py on an H200, N = 4096, float16 (docs/tune_mma_2026-11-29b.log,
# docs/tune_mma_2026-11-30b.log): the fastest candidate that compiles without spills for sm_80
# and sm_90, full or causal (scripts/ptx_check.py, strided arrays) and fits
# MMA_SHARED_MEMORY_BYTES. d64 (2026-11-29, commit 7e6c1f5, full): (32, 4, 2) 229.6 TFLOP/s
# against 215.8 for (32, 8, 2) and 205.1 for (64, 4, 1); again first on 2026-11-30 (233.7). d128
# (2026-11-30, commit ad937c6, since the ldmatrix addresses): (32, 4, 2) 262.0 full and 211.0
# causal, against 232.7 / 167.8 for (32, 8, 1) and 194.4 / 168.6 for (64, 8, 1), chosen before.
# Head dims up to 64 use the d64 entry, up to 128 the d128 one, up to 256 the d256 one; head
# dims that are not multiples of 16 run padded. d256 (sixth session) is supported, not tuned:
# one 16-row slice per warp, since its 16 x 256 output accumulator alone takes 128 registers
# a lane, and 16-key tiles (254 registers, no spills; 32-key tiles spill on sm_90:
# docs/ptx_d256_2026-11-30.log).
_MMA_FORWARD = (
    (64, MmaConfig(block_n=32, warps=4, slices=2)),
    (128, MmaConfig(block_n=32, warps=4, slices=2)),
    (256, MmaConfig(block_n=16, warps=4, slices=1)),
)


def mma_forward_shared_bytes(config, head_dim):
    """Shared memory of the tensor-core forward: the Q tile and one K and one V tile."""
    return 2 * (config.block_m + 2 * config.block_n) * (head_dim + ROW_PAD)


def mma_forward_config(head_dim):
    """The tensor-core forward's config for head_dim, or None if it has none."""
    return None if head_dim % 16 else _lookup(_MMA_FORWARD, head_dim)


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


# Chosen the same way, N = 4096, float16, full (fifth session, commit 6586110, with the ldmatrix
# addresses, which let larger tiles fit in registers; docs/tune_mma_2026-11-30b.log): d64
# (32, 64, 4, 2 stages) 162.6 TFLOP/s against 146.0 for (16, 64, 4, 2 stages) chosen before and
# 133.1 for (32, 32, 8, 2 stages); d128 (32, 32, 4, 2 stages) 148.4 against 122.6 for
# (16, 32, 4, 2 stages) and 115.1 for (16, 16, 8, 2 stages). ((16, 64, 4, 2 stages) at d128
# needs more than MMA_SHARED_MEMORY_BYTES. At d64, (64, 64, 4, 2 stages) timed 1-3 % faster in a
# later run, 163.8 against 162.0 full and 145.7 against 142.0 causal, within the runs' spread;
# it has not run the GPU tests, so it is not taken yet.)
_MMA_BACKWARD = (
    (64, MmaBackwardConfig(block_m=32, block_n=64, warps=4, stages=2)),
    (128, MmaBackwardConfig(block_m=32, block_n=32, warps=4, stages=2)),
    # d256: supported, not tuned; split in two halves of the head dim, one stage (two would
    # take more than MMA_SHARED_MEMORY_BYTES at 4 warps).
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


def mma_backward_config(head_dim):
    """The tensor-core backward's config for head_dim, or None if it has none (head_dim must
    split into d_split parts of a multiple of 16 columns)."""
    config = None if head_dim % 16 else _lookup(_MMA_BACKWARD, head_dim)
    return None if config is None or head_dim % (16 * config.d_split) else config
