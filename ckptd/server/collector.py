"""Garbage collection for a long-lived `ckptd serve` process (not for a training process:
the embedded coordinator leaves its host's settings alone).

CPython's young generation is collected whenever the count of tracked objects allocated and
still alive since the last collection passes a threshold (700 by default). A save holds
its ranks' plans, reports and answers until it ends, a few hundred objects a rank; below
the threshold each young collection walks them again and promotes them, and the older
generations walk them once more. Freed by reference counting when the save ends, they
never needed the collector. So the threshold follows the saves: a few hundred objects a rank of the saves in flight,
above a floor, so that a save's own objects never trigger a collection. It rises and never
falls: lowered after a large save, the next allocation would collect at once, walking every
object that outlived the save (the cached layouts of 16,384 ranks) in one pause, which the
benchmark saw as seconds of commit latency. Cyclic garbage (the collector's real work)
waits for at most about one largest save's worth of allocations. Measured at 4,096 ranks:
collection took 0.25 s of a save's 1.9 s of coordinator CPU at a fixed 50,000, and none
with the threshold above the save.
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


async def pace(core: Coordinator) -> None:
    """Raise the young threshold to young_threshold(the ranks of the saves in flight)
    whenever it is below, until cancelled (the service's lifetime)."""
    while True:
        want = young_threshold(ranks_in_flight(core))
        if want > gc.get_threshold()[0]:
            set_young(want)
        await asyncio.sleep(PACE_S)
