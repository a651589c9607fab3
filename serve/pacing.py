"""When to plan the next step under asynchronous scheduling: late planning.

With asynchronous scheduling (serve/scheduler.py) step k + 2 is planned as soon as step k's tokens
are read, that is when step k + 1 starts on the device. A request that arrives while k + 1 runs
then waits for k + 3: about one step longer than with synchronous scheduling, where the plan follows
the device. Late planning plans k + 2 as late as k + 1 allows instead: when what is left of k + 1's
device time is the host's time to plan and launch a step, plus a margin, so that requests arriving
meanwhile join k + 2 and the device still finds k + 2 queued when k + 1 ends.

:class:`StepClock` holds the estimates: per kind of decode step (its rows' bucket and whether a
variant is among them), the device time of such steps, the median of the last :data:`WINDOW`
measured (CUDA events around each step; the median, since a step that waited for the host to
compile or capture something measures that wait too); and the host's time to plan and launch a
step, the longest of the last :data:`WINDOW` (a slow launch leaves the device idle: err early), kept
apart for decode-only steps and for steps with prefill chunks, which take the host longer to stage.

The wait has two ends. While no request waits, the next step is a decode step, so the loop may
wait until what is left is a decode step's launch; once a request waits, its prompt may make the
next step one with prefill chunks, so the wait ends as soon as what is left is no more than that
launch (at once if that point has passed, or with no such launch measured yet). A request that
arrives up to a decode step's launch before the end still joins the next step; one that arrives in
the last stretch between the two launches' ends has the device wait for its step's staging, at most
the difference of the two, the price of its earlier first token. A launch that first waited for the
step in flight (to preempt, or for the tokens a grammar's mask needs) is not counted as the host's
time. A step with prefill chunks is never waited on, its time varies with its chunks, nor a kind
with fewer than :data:`MIN_SAMPLES` measurements; and the scheduler stops waiting as soon as the
step's tokens are in.
"""
from __future__ import annotations

from collections import deque
from statistics import median

WINDOW = 9       # measurements kept per estimate
MIN_SAMPLES = 3  # device times of a kind before it is waited on


class StepClock:
    """Estimates of decode steps' device time and the host's time to plan and launch one.

    Args:
        margin_s: seconds of device time left over the host's estimate when the plan starts.
        margin_frac: and this fraction of the step's device time on top (the step may run shorter
            than its median).
    """

    def __init__(self, margin_s: float = 0.5e-3, margin_frac: float = 0.1):
        self.margin_s, self.margin_frac = margin_s, margin_frac
        self.device: dict[tuple, deque] = {}  # kind of decode step -> its last device seconds
        self.host: deque = deque(maxlen=WINDOW)  # the last seconds to plan and launch a decode-only step
        self.host_prefill: deque = deque(maxlen=WINDOW)  # ... and a step with prefill chunks
        self.waited_s = 0.0                      # seconds the scheduler waited in all

    def observe_device(self, kind: tuple, seconds: float) -> None:
        """A decode step of ``kind`` (:func:`decode_kind`) ran ``seconds`` on the device."""
        self.device.setdefault(kind, deque(maxlen=WINDOW)).append(seconds)

    def observe_host(self, seconds: float, prefill: bool = False) -> None:
        """Planning and launching a step (with prefill chunks: ``prefill``) took the host ``seconds``."""
        (self.host_prefill if prefill else self.host).append(seconds)

    def slack(self, kind: tuple, running_s: float, prefill: bool = False) -> float:
        """Seconds to wait before planning the next step (one with prefill chunks: ``prefill``), while
        a decode step of ``kind`` has run ``running_s`` on the device: its median device time less what
        has run, the host's longest recent time to plan and launch such a step, and the margins; 0
        without the estimates, never negative."""
        times, host = self.device.get(kind), self.host_prefill if prefill else self.host
        if times is None or len(times) < MIN_SAMPLES or not host:
            return 0.0
        d = median(times)
        return max(0.0, d * (1.0 - self.margin_frac) - running_s - max(host) - self.margin_s)


def decode_kind(rows: int, with_variant: bool) -> tuple[int, bool]:
    """The kind of a decode step that :class:`StepClock` keeps apart: its rows' power-of-two bucket
    (the CUDA graphs' buckets, serve/graphs.py) and whether any row is on a variant."""
    return 1 << max(rows - 1, 0).bit_length(), with_variant
