"""Tile configurations of the Hopper kernels: one frozen dataclass, a table by head dim, and the
shared memory a config takes (hopper/layout.py lays it out)."""
from dataclasses import dataclass, replace

from ..config_table import lookup

WARPGROUP = 128
#: the consumers that can take turns (turns.py writes out a named barrier for each)
MAX_TURN_CONSUMERS = 3
#: registers per thread each role keeps (setmaxnreg) in a block of 2 consumer warpgroups:
#: the producer gives back what the consumers take, within what the block holds at launch
#: (launch_registers: launch_bounds=(threads, 1) caps every thread at 65536 / threads).
#: The producer's cp.async loop spills below 72 (d128 with every variant: 56 spilled 8
#: bytes); the d256 consumers below about 200.
REGISTERS = {2: (72, 216)}
#: with the copy engine one producer thread issues copies (in the backward's dK/dV kernel
#: its warp also writes each query tile's lse and D): it keeps 40 (at 24 a mask_mod's tile
#: classes spilled 80 bytes) and the consumers take the rest of the block's 64512; three
#: consumers (d64's 192-row tiles) fit in 160 with the producer at 32 (not with a boolean
#: mask: 8 bytes of spills)
COPY_ENGINE_REGISTERS = {2: (40, 232), 3: (32, 160)}
#: the backward's: its producer streams two 16-bit tiles per step with the other two held,
#: and spilled below 96 at d128, below 104 with every variant (its consumers fit in 200 with
#: 32-query tiles for dK/dV)
BACKWARD_REGISTERS = {2: (104, 200)}
#: the backward's with the copy engine: its producer warp issues copies and writes the stats
#: (at 40 the dK/dV kernel spilled 92 bytes; an attn_mask's dQ 52 at 56, so masked calls keep
#: BACKWARD_REGISTERS: wide_producer)
BACKWARD_COPY_ENGINE_REGISTERS = {2: (56, 224)}
#: the backward's with cp.async for a mask_mod with GQA (the masked table), by head dim: there
#: d128's dK/dV consumers spilled 44 bytes at 200, and the producer fits in 88 (without GQA it
#: spilled 16-48 bytes at 88, so those calls keep BACKWARD_REGISTERS); d64's dK/dV kernel of
#: a split group spilled 80 bytes at 88 / 208 and none at BACKWARD_REGISTERS
BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS = {128: (88, 208)}
#: shared memory a Hopper block may take (sm_90's opt-in limit)
HOPPER_SHARED_MEMORY_BYTES = 227 * 1024
#: the multiprocessor's registers; a block launched with launch_bounds=(threads, 1) holds
#: launch_registers(threads) of them, and setmaxnreg only moves registers within that: an inc
#: beyond what the decs gave back waits for ever
REGISTER_FILE = 65536


def launch_registers(threads):
    """Registers a block of `threads` holds at launch: each thread's cap (65536 / threads,
    down to a multiple of 8) times its threads."""
    return REGISTER_FILE // threads // 8 * 8 * threads


class _Roles:
    """A block of one producer warpgroup and `consumers` consumer warpgroups of 64 rows each;
    `register_table` gives each role's registers after setmaxnreg."""

    @property
    def rows(self):
        """The rows the consumers own together (64 each)."""
        return 64 * self.consumers

    @property
    def threads(self):
        return WARPGROUP * (1 + self.consumers)

    @property
    def registers(self):
        """(producer, consumer) registers per thread after setmaxnreg, within the block's
        registers at launch (else the consumers' setmaxnreg.inc would never return)."""
        if self.consumers not in self.register_table:
            raise ValueError(f"no register split for {self.consumers} consumers in "
                             f"{type(self).__name__}(copy_engine={self.copy_engine})")
        producer, consumer = self.register_table[self.consumers]
        if WARPGROUP * (producer + self.consumers * consumer) > launch_registers(self.threads):
            raise ValueError(f"{producer} producer and {consumer} consumer registers a thread "
                             f"exceed the {launch_registers(self.threads)} a block of "
                             f"{self.threads} threads holds")
        return producer, consumer


@dataclass(frozen=True)
class HopperConfig(_Roles):
    """Tile shape of the Hopper forward: consumers of 64 query rows each (block_m = 64 ·
    consumers), key tiles of block_n keys in a pipeline of `stages` K and V buffers; `turns`:
    the two consumers take turns at the tensor cores (hopper/turns.py), each holding one
    tile's P while the next tile's S accumulates; `copy_engine`: the producer brings tiles
    with the copy engine (tensor maps), else with cp.async."""

    block_n: int
    consumers: int = 2
    stages: int = 2
    turns: bool = True
    copy_engine: bool = True

    def __post_init__(self):
        if self.turns and self.consumers > MAX_TURN_CONSUMERS:
            raise ValueError(f"turns take up to {MAX_TURN_CONSUMERS} consumers; got "
                             f"{self.consumers}")

    @property
    def register_table(self):
        return COPY_ENGINE_REGISTERS if self.copy_engine else REGISTERS

    @property
    def block_m(self):
        return self.rows


_HOPPER_FORWARD = (
    (64, HopperConfig(block_n=128, consumers=3)),
    (128, HopperConfig(block_n=128)),
    (256, HopperConfig(block_n=64, turns=False)),  # (P held beside S and O spilled)
)
#: with an attn_mask, or a mask_mod with cp.async (read element by element on partial tiles,
#: on top of every other variant): the tiles at which no kernel spills (scripts/ptx_check.py
#: --hopper --variants; the plain table's spilled up to 232 bytes, or kept the scores in
#: local memory).
#: At d256 they would be 16 keys wide: those calls go to the mma.sync kernels.
_HOPPER_FORWARD_MASKED = (
    (64, HopperConfig(block_n=64)),
    (128, HopperConfig(block_n=32)),
)
#: with a mask_mod, no attn_mask and the copy engine: at d128 64-key tiles, where a mask_mod
#: compiles clean with causal, softcap and GQA (ptx_check's spec; once also with ALiBi and a
#: window: docs/KERNEL_NOTES.md) while a floating mask spilled 8 bytes and cp.async's 216
#: consumer registers 64; at d64 128 keys spilled 48 with softcap and GQA. The fallback of
#: the plain table's tiles, which the engine takes where they compile clean for the call
#: (key_tiles.py: with contiguous arrays they did for a document mask_mod with softcap and
#: GQA; with strided ones d64's kept 64-72 bytes in local memory, d128's 8 beside softcap)
_HOPPER_FORWARD_MASK_MOD = (
    (64, HopperConfig(block_n=64)),
    (128, HopperConfig(block_n=64)),
)
#: with a boolean attn_mask and not both softcap and ALiBi: the plain tiles of two consumers,
#: which compile without spills there (a boolean mask costs the consumers a load and a test
#: per element of a partial tile; a floating one, or a mask_mod's tile tables, more: 148-488
#: bytes of spills at block_n 128; a boolean mask with softcap and ALiBi at d128 32-100;
#: docs/KERNEL_NOTES.md, "Masks on the plain Hopper tiles")
_HOPPER_FORWARD_BOOL_MASKED = (
    (64, HopperConfig(block_n=128)),
    (128, HopperConfig(block_n=128)),
)
#: with cp.async (maps the driver refuses; hopper_forward_config clears
#: copy_engine): two consumers, since the producer's 128 copying threads keep 72 registers
#: and three consumers' wgmma had too few in the rest (ptxas serialised them). Varlen takes
#: it with the copy engine too: at d64 three consumers spilled 120-168 bytes holding a
#: sequence's bounds.
_HOPPER_FORWARD_CP_ASYNC = _HOPPER_FORWARD_BOOL_MASKED + _HOPPER_FORWARD[2:]


@dataclass(frozen=True)
class HopperBackwardConfig(_Roles):
    """Tile shape of the Hopper backward: consumers of 64 rows each (rows: keys of a dK/dV
    block, queries of a dQ block), dK/dV looping over query tiles of block_m and dQ over key
    tiles of block_n, each in a pipeline of `stages` buffers: at least 3, since a dQ consumer
    frees tile j's stage in the turn that needs tile j + 1 (turns.py), and the producer
    with cp.async announces tile j + 1 once it has issued tile j + 2's copies (with 2 stages,
    into tile j's stage: a deadlock); `copy_engine` as HopperConfig's; `wide_producer`: the
    producer keeps BACKWARD_REGISTERS' share with the copy engine too (a mask_mod's tile
    tables and walk in its loop spilled below 104 registers); `register_split`: (producer,
    consumer) registers a thread instead of the tables' (two consumers)."""

    block_m: int
    block_n: int
    consumers: int = 2
    stages: int = 3
    copy_engine: bool = True
    wide_producer: bool = False
    register_split: tuple = ()

    def __post_init__(self):
        if self.stages < 3:
            raise ValueError(f"the Hopper backward needs 3 stages or more; got {self.stages}")

    @property
    def register_table(self):
        if self.register_split:
            return {2: self.register_split}
        lean = self.copy_engine and not self.wide_producer
        return BACKWARD_COPY_ENGINE_REGISTERS if lean else BACKWARD_REGISTERS


# d256: dK and dV of 64 keys would take the consumers' every register (the mma.sync backward
# splits the head dim there; these kernels do not yet).
_HOPPER_BACKWARD = (
    (64, HopperBackwardConfig(block_m=64, block_n=64)),
    (128, HopperBackwardConfig(block_m=64, block_n=64)),  # (224 consumer registers)
)
#: with no window, ALiBi or varlen: d64's dQ on 128-key tiles and four stages, 7 % faster than
#: 64-key tiles and three (H100, causal, N 4096: PERFORMANCE.md); ptxas spilled 616 bytes
#: there with a window, 196 with ALiBi, 24-32 with varlen, none with softcap or GQA
_HOPPER_BACKWARD_WIDE_KEYS = (
    (64, HopperBackwardConfig(block_m=64, block_n=128, stages=4)),
) + _HOPPER_BACKWARD[1:]
#: with cp.async (maps the driver refuses): 200 consumer registers, in which the
#: d128 dK/dV kernel's 64-query tiles spilled 704 bytes
_HOPPER_BACKWARD_CP_ASYNC = (
    (64, HopperBackwardConfig(block_m=64, block_n=64, copy_engine=False)),
    (128, HopperBackwardConfig(block_m=32, block_n=64, copy_engine=False)),
)
#: with an attn_mask, or a mask_mod with cp.async (as _HOPPER_FORWARD_MASKED; the plain
#: table's dK/dV spilled up to 456 bytes, its dQ 112)
_HOPPER_BACKWARD_MASKED = (
    (64, HopperBackwardConfig(block_m=32, block_n=64, wide_producer=True)),
    (128, HopperBackwardConfig(block_m=16, block_n=32, wide_producer=True)),
)
#: with a mask_mod, no attn_mask, no GQA and the copy engine: d128's dQ on 64-key tiles (a
#: floating mask's spilled 68 bytes there; with cp.async it compiled clean for varlen too, but
#: keeps the masked table beside the forward's), dK/dV on twice the masked table's query
#: tiles, the producer lean (with the wide one, dK/dV's 32-query tiles spilled 288-360 bytes)
_HOPPER_BACKWARD_MASK_MOD = (
    (64, HopperBackwardConfig(block_m=64, block_n=64)),
    (128, HopperBackwardConfig(block_m=32, block_n=64)),
)
#: the same with GQA: the lean producer, walking the group's heads, spilled 104-120 bytes
_HOPPER_BACKWARD_MASK_MOD_GQA = (
    (64, HopperBackwardConfig(block_m=32, block_n=64, wide_producer=True)),
    (128, HopperBackwardConfig(block_m=16, block_n=64, wide_producer=True)),
)


def column_blocks(head_dim):
    """64-column blocks of a tile's rows (the 128-byte swizzle's row width, 16-bit data)."""
    return -(-head_dim // 64)


def tile_bytes(rows, head_dim):
    return rows * column_blocks(head_dim) * 128


def hopper_forward_shared_bytes(config, head_dim):
    """The Q tile, `stages` K and V tiles, and 1024 bytes to align them to the swizzle's
    atoms (the mbarriers are static shared memory)."""
    return (tile_bytes(config.block_m, head_dim)
            + 2 * config.stages * tile_bytes(config.block_n, head_dim) + 1024)


def hopper_backward_shared_bytes(config, head_dim):
    """(dK/dV, dQ) dynamic shared memory: the block's two tiles of `rows` rows (K and V; Q and
    dO), `stages` pairs of streamed tiles (Q and dO of block_m rows; K and V of block_n), and
    1024 bytes of alignment (lse and D of the streamed queries: static shared memory)."""
    fixed = 2 * tile_bytes(config.rows, head_dim) + 1024
    return (fixed + 2 * config.stages * tile_bytes(config.block_m, head_dim),
            fixed + 2 * config.stages * tile_bytes(config.block_n, head_dim))


def _table(spec, copy_engine, tables):
    """The table of a call from (plain, cp_async, masked, mask_mod): an attn_mask's (also
    beside a mask_mod); a mask_mod's on the copy engine (with cp.async the forward's consumers
    keep fewer registers, and both kernels keep the masked table); else by how the tiles are
    copied."""
    plain, cp_async, masked, mask_mod = tables
    if spec.attn_mask is not None or (spec.mask_mod is not None and not copy_engine):
        return masked
    if spec.mask_mod is not None:
        return mask_mod
    return plain if copy_engine else cp_async


def hopper_backward_config(head_dim, spec, copy_engine=True):
    """The Hopper backward's config for head_dim (64 or 128) and the call's spec, or None;
    copy_engine=False: the config for cp.async copies. A mask_mod with GQA and varlen keeps
    cp.async (its dK/dV kernel spilled 32 bytes on the copy engine: at d64 at every register
    split, at d128 with the mask test of a mask_mod's tiles branch-free; on cp.async it
    compiles clean: ptx_check's mask_mod_varlen spec)."""
    copy_engine = copy_engine and not (spec.varlen and spec.mask_mod is not None
                                       and spec.group > 1)
    mask_mod = _HOPPER_BACKWARD_MASK_MOD if spec.group == 1 else _HOPPER_BACKWARD_MASK_MOD_GQA
    table = _table(spec, copy_engine, (_HOPPER_BACKWARD, _HOPPER_BACKWARD_CP_ASYNC,
                                       _HOPPER_BACKWARD_MASKED, mask_mod))
    if table is _HOPPER_BACKWARD and not (spec.window_left >= 0 or spec.window_right > 0
                                          or spec.alibi or spec.varlen):
        table = _HOPPER_BACKWARD_WIDE_KEYS
    config = None if head_dim % 16 else lookup(table, head_dim)
    if config and not copy_engine:
        config = replace(config, copy_engine=False)
    split = BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS.get(head_dim)
    if split and config and not config.copy_engine and spec.mask_mod is not None and \
            spec.group > 1:
        return replace(config, register_split=split)
    return config


#: the forward's (plain, cp_async, masked, mask_mod) tables, as _table takes them
_FORWARD_TABLES = (_HOPPER_FORWARD, _HOPPER_FORWARD_CP_ASYNC, _HOPPER_FORWARD_MASKED,
                   _HOPPER_FORWARD_MASK_MOD)


def hopper_forward_config(head_dim, spec, copy_engine=True):
    """The Hopper forward's config for head_dim (a multiple of 16) and the call's spec, or
    None; copy_engine=False: the config for cp.async copies."""
    table = _table(spec, copy_engine, _FORWARD_TABLES)
    if spec.varlen and table is _HOPPER_FORWARD:
        table = _HOPPER_FORWARD_CP_ASYNC  # (two consumers, on the copy engine)
    if spec.bool_mask and spec.mask_mod is None and not (spec.softcap and spec.alibi):
        table = _HOPPER_FORWARD_BOOL_MASKED
    config = None if head_dim % 16 else lookup(table, head_dim)
    if config and not copy_engine:
        return replace(config, copy_engine=False)
    return config


def mask_mod_wide_forward_config(head_dim, spec):
    """For a call hopper_forward_config gives the mask_mod table's config: the plain table's
    (128-key tiles, the copy engine; varlen's two consumers at d64), or None for other
    calls. The engine takes it where the call's forward compiles there without local memory
    (key_tiles.py): 64-key tiles cost 15-25 % of the forward's speed, but at 128 keys some
    calls spill (a mask_mod's code, the variants, strided arrays), and those compile both
    kernels on their first call."""
    if (head_dim % 16 or _table(spec, True, _FORWARD_TABLES) is not _HOPPER_FORWARD_MASK_MOD
            or lookup(_HOPPER_FORWARD_MASK_MOD, head_dim) is None):
        return None
    return lookup(_HOPPER_FORWARD_CP_ASYNC if spec.varlen else _HOPPER_FORWARD, head_dim)
