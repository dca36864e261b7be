"""Garbage collection for a long-lived `ckptd serve` process (not for a training process:
the embedded coordinator leaves its host's settings alone).

CPython's young generation is collected whenever the count of tracked objects allocated and
still alive since the last collection passes a threshold (700 by default). A save holds
its ranks' plans, reports and answers until it ends, a few hundred objects a rank; below
the threshold each young collection walks them again and promotes them, and the older
generations walk them once more. Freed by reference counting when the save ends, they
never needed the collector. So while saves are in flight the threshold follows them: a few
hundred objects a rank of the saves in flight, above a floor, so that a save's own objects
never trigger a collection. Measured at 4,096 ranks: collection took 0.25 s of a save's
1.9 s of coordinator CPU at a fixed 50,000, and none with the threshold above the save.

The collector's real work is cyclic garbage, and every RPC leaves some (grpc.aio's
per-call handler lookup: a closure, its call details and metadata, about five objects a
call). With the threshold that high it piled up for a whole save's worth of allocations:
at 4,096 ranks calling one by one, the soak's coordinator grew by 20 MiB a round. So when
no save is in flight the pacer collects what is due at once (the generations CPython's own
trigger would pick, by the same counts) and lowers the threshold to the floor again: the
pause falls between saves, where nobody waits on the coordinator, and it walks only what
was allocated since the last collection. Lowering it without that collection would make
the next allocation, whenever it came (in the next save), walk everything that outlived
the save in one pause: seconds of commit latency at 16,384 ranks. A service whose saves
always overlap is never idle; its garbage then waits for at most about one largest
save's worth of allocations, as before.
"""

from __future__ import annotations

import asyncio
import gc

from ckptd.coordinator.core import Coordinator
from ckptd.coordinator.types import ABORTED, COMMITTED

# The floor: the service between saves (catalog, caches) and its RPCs' transient objects.
GC_YOUNG = 50_000
# Objects a rank of a save in flight keeps alive (about 325 measured at 4,096 ranks with
# cached plans; whole plans hold more), with room to spare.
GC_PER_RANK = 800
# How often the threshold follows the saves; a save's plans take seconds to arrive.
PACE_S = 0.5


def young_threshold(ranks_in_flight: int) -> int:
    return max(GC_YOUNG, GC_PER_RANK * ranks_in_flight)


def set_young(threshold: int) -> None:
    young, older, oldest = gc.get_threshold()
    if young != threshold:
        gc.set_threshold(threshold, older, oldest)


def ranks_in_flight(core: Coordinator) -> int:
    return sum(
        s.world_size for s in list(core.sessions.values()) if s.status not in (COMMITTED, ABORTED)
    )


def collect_due() -> int:
    """Collect the generations CPython's allocation trigger would collect now: the oldest
    whose count (collections of the one below since its last) passed its threshold, else
    the young one. The number of unreachable objects found."""
    _, older, oldest = gc.get_threshold()
    _, count1, count2 = gc.get_count()
    generation = 0
    if count1 > older:
        generation = 2 if count2 > oldest else 1
    return gc.collect(generation)


async def pace(core: Coordinator) -> None:
    """Until cancelled (the service's lifetime): while saves are in flight raise the young
    threshold to young_threshold(their ranks) whenever it is below; when none is, collect
    what is due if the young generation holds at least the floor's worth or the threshold
    was raised, and set the threshold back to the floor."""
    while True:
        flying = ranks_in_flight(core)
        if flying or core.memory_saves:  # a save to storage or to memory is in flight
            want = young_threshold(flying)
            if want > gc.get_threshold()[0]:
                set_young(want)
        elif gc.get_threshold()[0] > GC_YOUNG or gc.get_count()[0] >= GC_YOUNG:
            # Idle: a collection now delays no one.
            collect_due()
            set_young(GC_YOUNG)
        await asyncio.sleep(PACE_S)
