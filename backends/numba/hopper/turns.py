"""Two consumer warpgroups taking turns at the tensor cores (FlashAttention-3's ping-pong
schedule): while one issues its products, the other runs its softmax on CUDA cores.

Consumer c waits for its turn at named barrier 1 + c and, once its products are issued, gives
the turn to the other consumer at the other's barrier (bar.arrive, which does not wait). Each
barrier counts 256 threads: the 128 that wait and the 128 that arrive. Consumer 1 opens by
giving consumer 0 the first turn; so that every arrival meets a wait by the end (no barrier
left half full when the block exits), both take the same number of turns and consumer 1 gives
none after its last.
"""
from numba import cuda

from ..device.intrinsics import named_barrier_arrive, named_barrier_sync

#: the two consumers' named barriers (0 is syncthreads'): both warpgroups count
TURN_THREADS = 256


@cuda.jit(device=True, inline="always")
def open_turns(consumer):
    """Consumer 1 gives consumer 0 its first turn (once, before either takes one)."""
    if consumer == 1:
        named_barrier_arrive(1, TURN_THREADS)


@cuda.jit(device=True, inline="always")
def take_turn(consumer):
    """Wait until the other consumer has issued its products."""
    if consumer == 0:
        named_barrier_sync(1, TURN_THREADS)
    else:
        named_barrier_sync(2, TURN_THREADS)


@cuda.jit(device=True, inline="always")
def give_turn(consumer, last):
    """The products of this turn are issued: the other consumer may issue its own. `last`:
    this consumer's last turn (consumer 1 then gives none: consumer 0 takes no more)."""
    if consumer == 0:
        named_barrier_arrive(2, TURN_THREADS)
    elif not last:
        named_barrier_arrive(1, TURN_THREADS)
