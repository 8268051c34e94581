"""How busy the machine is, for the demo's thread count and its benchmark rows' noise mark.

The 1-minute load average lags by minutes and counts this process's own threads: right after scripts/demo.sh's build
it still counted the compiler (the demo then chose one thread on an idle machine), and the engine's rows on two
threads of a 2-core machine read 2.5-2.8 with nothing else running (every row marked noisy). What matters is the
cores *other* processes take while a row runs: the machine's busy time (Linux /proc/stat) minus this process's and its
waited-for children's CPU time. Where /proc/stat is missing, the load average stands in.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["OTHERS_NOISY_CORES", "MachineClock", "busy_cores", "load_average", "usable_cores"]

# A row is noisy when other processes kept more than this many cores busy on average while it ran: on 2 cores, a
# quarter of a core taken from a two-thread op stalls its other thread (measured 3x slower target steps when every
# core had a thread and other processes also ran).
OTHERS_NOISY_CORES = 0.25


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _machine_ticks() -> tuple[int, int] | None:
    """(all, idle + iowait) clock ticks of every core since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest time is within user)
    except (OSError, ValueError):
        return None
    return (sum(ticks), ticks[3] + ticks[4]) if len(ticks) == 8 else None


def _busy_between(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (os.cpu_count() or 1) * (1 - (end[1] - start[1]) / (end[0] - start[0]))


def busy_cores(window: float = 1.0) -> float:
    """Cores busy over the next ``window`` seconds (every process; this one sleeps meanwhile); elsewhere the 1-minute
    load average."""
    start = _machine_ticks()
    time.sleep(window)
    busy = _busy_between(start, _machine_ticks())
    return os.getloadavg()[0] if busy is None else busy


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class MachineClock:
    """Started before a row's calls; :meth:`row` after them says what the row records of the machine."""

    load_before: list[float]
    ticks: tuple[int, int] | None
    own_cpu: float
    wall: float

    @classmethod
    def start(cls) -> MachineClock:
        return cls(load_average(), _machine_ticks(), _own_cpu_seconds(), time.monotonic())

    def others_busy(self) -> float | None:
        """Cores other processes kept busy on average since the start (None without /proc/stat)."""
        machine = _busy_between(self.ticks, _machine_ticks())
        wall = time.monotonic() - self.wall
        if machine is None or wall <= 0:
            return None
        return max(0.0, machine - (_own_cpu_seconds() - self.own_cpu) / wall)

    def row(self, threads: int, cores: int) -> dict:
        """The load average before and after, the threads and cores, the cores other processes took, and whether the
        row is noisy: other processes took more than OTHERS_NOISY_CORES (without /proc/stat: a load average above
        the core count)."""
        others = self.others_busy()
        after = load_average()
        noisy = max(self.load_before[0], after[0]) > cores if others is None else others > OTHERS_NOISY_CORES
        return {
            "load_before": self.load_before,
            "load_after": after,
            "others_busy_cores": None if others is None else round(others, 2),
            "threads": threads,
            "cores": cores,
            "noisy": noisy,
        }
