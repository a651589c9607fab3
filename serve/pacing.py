"""When to plan the next step under asynchronous scheduling: late planning.

With asynchronous scheduling (serve/scheduler.py) step k + 2 is planned as soon as step k's tokens
are read, that is when step k + 1 starts on the device. A request that arrives while k + 1 runs
then waits for k + 3: about one step longer than with synchronous scheduling, where the plan follows
the device. Late planning plans k + 2 as late as k + 1 allows instead: when what is left of k + 1's
device time is the host's time to plan and launch a step, plus a margin, so that requests arriving
meanwhile join k + 2 and the device still finds k + 2 queued when k + 1 ends.

:class:`StepClock` holds the estimates: per kind of decode step (its rows' bucket and whether a
variant is among them), the device time of such steps (an exponentially weighted mean of their
measured durations: CUDA events around each step), and the host's time to plan and launch a decode
step (the same mean). A step with prefill chunks is never waited on: its time varies with its
chunks. Without an estimate there is no wait.
"""
from __future__ import annotations


class StepClock:
    """Estimates of decode steps' device time and the host's time to plan and launch one.

    Args:
        weight: the weight of each new measurement in the exponentially weighted means.
        margin_s: seconds of device time left over the host's estimate when the plan starts.
        margin_frac: and this fraction of the step's device time on top (the step may run shorter
            than its mean).
    """

    def __init__(self, weight: float = 0.2, margin_s: float = 0.5e-3, margin_frac: float = 0.1):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight, self.margin_s, self.margin_frac = weight, margin_s, margin_frac
        self.device: dict[tuple, float] = {}  # kind of decode step -> mean device seconds
        self.host: float | None = None        # mean seconds to plan and launch a decode step
        self.waited_s = 0.0                   # seconds the scheduler waited on :meth:`slack` in all

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def observe_device(self, kind: tuple, seconds: float) -> None:
        """A decode step of ``kind`` (:func:`decode_kind`) ran ``seconds`` on the device."""
        self.device[kind] = self._mean(self.device.get(kind), seconds)

    def observe_host(self, seconds: float) -> None:
        """Planning and launching a decode step took the host ``seconds``."""
        self.host = self._mean(self.host, seconds)

    def slack(self, kind: tuple, running_s: float) -> float:
        """Seconds to wait before planning the next step, while a decode step of ``kind`` has run
        ``running_s`` on the device: its mean device time less what has run, the host's mean time
        to plan and launch and the margins; 0 without both estimates, never negative."""
        d = self.device.get(kind)
        if d is None or self.host is None:
            return 0.0
        return max(0.0, d * (1.0 - self.margin_frac) - running_s - self.host - self.margin_s)


def decode_kind(rows: int, with_variant: bool) -> tuple[int, bool]:
    """The kind of a decode step that :class:`StepClock` keeps apart: its rows' power-of-two bucket
    (the CUDA graphs' buckets, serve/graphs.py) and whether any row is on a variant."""
    return 1 << max(rows - 1, 0).bit_length(), with_variant
