"""A choice between two ways of one step, made at its first call by timing both."""

from __future__ import annotations

import math
import time
from typing import Callable

__all__ = ["CLEARLY_FASTER", "faster"]

# How much faster a new way must run than the one it would replace to be chosen: a margin
# over the noise of two timed runs on a shared machine (the ways it decides between differ
# by 1.5-3x where one clearly fits the shape).
CLEARLY_FASTER = 0.9


def faster(first: Callable[[], None], second: Callable[[], None], rounds: int = 2) -> bool:
    """Whether ``first`` runs clearly faster than ``second`` (the way it would replace):
    each run ``rounds`` times, alternating, the best time of each compared, ``first``'s
    under ``CLEARLY_FASTER`` of ``second``'s (a choice between two ways of one step made
    on this machine, on the step's own shape, where no rule fits every CPU)."""
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for index, run in enumerate((first, second)):
            started = time.perf_counter()
            run()
            best[index] = min(best[index], time.perf_counter() - started)
    return best[0] < CLEARLY_FASTER * best[1]
