"""Ring attention (context parallelism) over torch.distributed: the sequence is sharded across
the ranks of a process group, each rank attends its query shard to every key/value shard as
the shards travel the ring, and the partial results are combined exactly by
numba_flash.merge.

    import torch.distributed as dist, numba_flash.torch as nft
    q, k, v = (nft.shard_sequence(x, layout="zigzag") for x in (q_full, k_full, v_full))
    out = nft.ring_attention(q, k, v, causal=True, layout="zigzag")   # this rank's shard
    out.sum().backward()                                              # shard gradients

Step i of world: rank r holds the key/value shard of rank (r − i) mod world and makes the
attention calls numba_flash/ring_plan.py plans for that pair of shards, while the shard moves
on to rank r + 1 (one batch_isend_irecv: with NCCL the copy runs on NCCL's stream, behind the
kernels already queued on the current stream, and the next step's kernels wait for it). The
running output and log-sum-exp are float32 and merged after each call. The backward walks
the ring again with the saved output and lse: dq stays home; each key/value shard's float32
dK/dV travel with it, gathering every rank's share in ring order (deterministic for a fixed
world size), and take one last hop home.
"""
import math
import struct

import torch
import torch.distributed as dist

from numba_flash import _checks, api, registry, ring_plan, spec
from numba_flash.merge import merge
from numba_flash.spec import NO_WINDOW

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ring_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW,
                   softcap=0.0, group=None, layout="zigzag", backend="auto"):
    """Differentiable exact attention of a sequence sharded across the ranks of `group` (the
    default group if None). q: this rank's shard (batch, seqlen / world, nheads, headdim); k,
    v: (batch, seqlen / world, nheads_kv, headdim) (GQA: nheads a multiple of nheads_kv),
    sharded by the same layout ("zigzag": rank r holds chunks r and 2·world − 1 − r of
    2·world; "contiguous": chunk r of world; shard_sequence makes either). causal and
    window_size are in the positions of the whole sequence; softcap and the backend as in
    numba_flash.forward (ALiBi, masks and mask_mod depend on positions the shards do not
    have and are not taken). Returns this rank's shard of the output; every rank of the
    group must call it with shards of the same shapes and the same options (checked: every
    rank raises the same error otherwise)."""
    # (the options are checked inside _ring, with the arrays: an error on one rank only must
    # reach the others before any of them waits for a message)
    options = _Options(causal, softmax_scale, window_size, softcap, backend)
    ring = _ring(group, layout, q, k, v, options)
    return RingAttentionFunction.apply(q, k, v, ring, options.call_options(q.shape[-1]))


class _Options:
    def __init__(self, causal, softmax_scale, window, softcap, backend):
        self.causal, self.softmax_scale, self.window = causal, softmax_scale, window
        self.softcap, self.backend = softcap, backend

    def global_window(self):
        left, right = spec.check_window_size(self.window)
        return left, 0 if spec.check_causal(self.causal) else right

    def call_options(self, head_dim):
        return dict(softmax_scale=spec.resolve_softmax_scale(self.softmax_scale, head_dim),
                    softcap=spec.check_softcap(self.softcap), backend=self.backend)

    def fingerprint(self):
        """The options as int64s, to compare across ranks."""
        scale = -1.0 if self.softmax_scale is None else float(self.softmax_scale)
        return [*self.global_window(), _float_bits(scale), _float_bits(float(self.softcap))]


class RingAttentionFunction(torch.autograd.Function):
    """The ring forward and backward as one autograd node (per rank)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, options):
        out, lse = _ring_forward(q, k, v, ring, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.options = ring, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring,
                                    ctx.options)
        return dq, dk, dv, None, None


class _Ring:
    """The ring as this rank sees it: its neighbours' global ranks and the plan."""

    def __init__(self, group, rank, world, plan):
        self.group, self.rank, self.world, self.plan = group, rank, world, plan
        self.send_to = dist.get_global_rank(group, (rank + 1) % world)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % world)

    def start_shift(self, tensor):
        """Send tensor to the next rank and receive the previous rank's: (the buffer it
        arrives in, the works to wait for before reading it)."""
        arrived = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.send_to, self.group),
            dist.P2POp(dist.irecv, arrived, self.recv_from, self.group)])
        return arrived, works


def _finish(shift):
    arrived, works = shift
    for work in works:
        work.wait()
    return arrived


def _ring_forward(q, k, v, ring, options):
    batch, shard_len, nheads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads, shard_len), -math.inf, dtype=torch.float32,
                     device=q.device)
    kv = torch.stack((k, v))  # one message a step (check_qkv: k and v have one shape)
    for step, (_, calls) in enumerate(ring.plan):
        shift = ring.start_shift(kv) if step + 1 < ring.world else None
        for call, rows, keys in _slices(calls):
            part_out, part_lse = api.forward(q[:, rows], kv[0, :, keys], kv[1, :, keys],
                                             window_size=call.window, **options)
            out[:, rows], lse[:, :, rows] = merge([out[:, rows], part_out],
                                                  [lse[:, :, rows], part_lse])
        if shift is not None:
            kv = _finish(shift)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring, options):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    # dK and dV of the key/value shard this rank holds, so far; and the next one, arriving
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
    arriving = None
    for step, (_, calls) in enumerate(ring.plan):
        shift = ring.start_shift(kv) if step + 1 < ring.world else None
        grads = [api.backward(dout[:, rows], q[:, rows], kv[0, :, keys], kv[1, :, keys],
                              out[:, rows], lse[:, :, rows].contiguous(),
                              window_size=call.window, **options)
                 for call, rows, keys in _slices(calls)]
        if arriving is not None:
            dkv = _finish(arriving)
        for (_, rows, keys), (dq_part, dk_part, dv_part) in zip(_slices(calls), grads):
            dq[:, rows] += dq_part
            dkv[0, :, keys] += dk_part
            dkv[1, :, keys] += dv_part
        if ring.world > 1:  # on to the next rank (after the last step: home)
            arriving = ring.start_shift(dkv)
        if shift is not None:
            kv = _finish(shift)
    if arriving is not None:
        dkv = _finish(arriving)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _slices(calls):
    return [(call, slice(call.q_begin, call.q_end), slice(call.k_begin, call.k_end))
            for call in calls]


# -- the checks: every rank learns every rank's problem before any rank sends a shard --------

def _ring(group, layout, q, k, v, options):
    """The checked _Ring: the local checks on each rank, then one all-gather of the shapes
    and options, so that a problem on one rank is an error on all of them, not a hang."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs an initialised torch.distributed process "
                           "group: call torch.distributed.init_process_group first")
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group it was "
                         "given")
    problem = _local_problem(layout, q, k, v, options)
    rows = _all_gather_rows(group, _fingerprint(problem, layout, q, k, v, options))
    if any(row[0] for row in rows):
        messages = [None] * world
        dist.all_gather_object(messages, problem, group=group)
        bad = [(r, m) for r, m in enumerate(messages) if m is not None]
        raise ValueError("ring_attention: " + "; ".join(f"rank {r}: {m}" for r, m in bad))
    for name, columns in (("q's shape", slice(4, 8)), ("k's shape", slice(8, 12)),
                          ("v's shape", slice(12, 16)), ("dtype", slice(3, 4)),
                          ("the layout", slice(1, 2)), ("the options", slice(16, None))):
        values = [tuple(row[columns]) for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"ring_attention needs the same shard shapes and options on every "
                             f"rank of the group: {name} differs (by rank: {values})")
    plan = ring_plan.ring_plan(layout, rank, world, int(q.shape[1]), *options.global_window())
    return _Ring(group, rank, world, plan)


def _local_problem(layout, q, k, v, options):
    """This rank's reason to refuse the call (a message), or None."""
    try:
        ring_plan.check_layout(layout)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise TypeError(f"{name} must be a 4-D torch tensor (batch, shard, nheads, "
                                f"headdim); got {type(x).__name__}"
                                + (f" of {x.dim()} dimensions" if isinstance(x, torch.Tensor)
                                   else ""))
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"q and k shards must have as many positions; got {q.shape[1]} "
                             f"and {k.shape[1]}")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"a zigzag shard holds two equal chunks: its length must be "
                             f"even; got {q.shape[1]}")
        _checks.check_qkv(q, k, v)
        call_spec = spec.make_spec(q, k, causal=options.causal,
                                   softmax_scale=options.softmax_scale,
                                   window_size=options.window, softcap=options.softcap)
        registry.resolve(options.backend, call_spec, q, k, v)
    except (TypeError, ValueError, RuntimeError) as error:
        return str(error)
    return None


def _fingerprint(problem, layout, q, k, v, options):
    def shape(x):
        dims = list(x.shape) if isinstance(x, torch.Tensor) else []
        return (dims + [-1] * 4)[:4]
    if problem is not None:
        return [1] + [0] * 19
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    return ([0, ring_plan.LAYOUTS.index(layout), 0, dtype] + shape(q) + shape(k) + shape(v)
            + options.fingerprint())


def _all_gather_rows(group, row):
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", x))[0]


# -- sharding ---------------------------------------------------------------------------------

def shard_sequence(x, group=None, layout="zigzag", dim=1):
    """This rank's shard of x, the whole sequence along `dim` (every rank passes the same
    x): the rows ring_attention expects for `layout`. A copy (contiguous); differentiable.
    The length must be a multiple of world ("contiguous") or 2·world ("zigzag")."""
    rank, world = _rank_and_world(group)
    seqlen = x.shape[dim]
    divisor = ring_plan.shard_divisor(layout, world)
    if seqlen % divisor:
        raise ValueError(f"x: a {layout} shard of {world} ranks needs a sequence length that is "
                         f"a multiple of {divisor}; got {seqlen} (pad the sequence, and mask "
                         f"the padding out of the loss)")
    shard_len = seqlen // world
    pieces = [x.narrow(dim, s.start, s.length)
              for s in ring_plan.segments(layout, rank, world, shard_len)]
    return torch.cat(pieces, dim=dim).contiguous()


def unshard_sequence(x, group=None, layout="zigzag", dim=1):
    """The whole sequence from every rank's shard x (along `dim`), in order, on every rank
    (one all_gather). For results and checks: it carries no gradient."""
    _, world = _rank_and_world(group)
    ring_plan.check_layout(layout)
    shard_len = x.shape[dim]
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"x: a zigzag shard holds two equal chunks: its length must be even; "
                         f"got {shard_len}")
    x = x.detach().contiguous()
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x, group=group)
    pieces = [(s.start, shard.narrow(dim, s.row, s.length)) for r, shard in enumerate(shards)
              for s in ring_plan.segments(layout, r, world, shard_len)]
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim=dim)


def _rank_and_world(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_sequence and unshard_sequence need an initialised "
                           "torch.distributed process group")
    group = dist.group.WORLD if group is None else group
    return dist.get_rank(group), dist.get_world_size(group)
