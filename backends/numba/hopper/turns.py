"""Consumer warpgroups taking turns at the tensor cores (FlashAttention-3's ping-pong
schedule, a ring for more than two): while one issues its products, the others run their
softmax on CUDA cores.

Consumer c waits for its turn at named barrier 1 + c and, once its products are issued, gives
the turn to the next consumer (c + 1, the last to 0) at that one's barrier (bar.arrive, which
does not wait). Each barrier counts 256 threads: the 128 that wait and the 128 that arrive.
The last consumer opens by giving consumer 0 the first turn; so that every arrival meets a
wait by the end (no barrier left half full when the block exits), all take the same number of
turns and the last gives none after its last. Up to three consumers (bar.sync takes a literal
id: the barriers are written out; config.MAX_TURN_CONSUMERS).
"""
from numba import cuda

from ..device.intrinsics import named_barrier_arrive, named_barrier_sync

#: the consumers' named barriers (0 is syncthreads'): two warpgroups count at each
TURN_THREADS = 256


@cuda.jit(device=True, inline="always")
def open_turns(consumer, consumers):
    """The last consumer gives consumer 0 its first turn (once, before any takes one)."""
    if consumer == consumers - 1:
        named_barrier_arrive(1, TURN_THREADS)


@cuda.jit(device=True, inline="always")
def take_turn(consumer):
    """Wait until the consumer before has issued its products."""
    if consumer == 0:
        named_barrier_sync(1, TURN_THREADS)
    elif consumer == 1:
        named_barrier_sync(2, TURN_THREADS)
    else:
        named_barrier_sync(3, TURN_THREADS)


@cuda.jit(device=True, inline="always")
def give_turn(consumer, consumers, last):
    """The products of this turn are issued: the next consumer may issue its own. `last`:
    this consumer's last turn (the last consumer then gives none: consumer 0 takes no
    more)."""
    if consumer == consumers - 1:
        if not last:
            named_barrier_arrive(1, TURN_THREADS)
    elif consumer == 0:
        named_barrier_arrive(2, TURN_THREADS)
    else:
        named_barrier_arrive(3, TURN_THREADS)
