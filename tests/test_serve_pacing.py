"""Late planning (serve/pacing.py): the estimates of ``StepClock`` and, in the scheduler, a request
submitted while the loop waits on them joins the step right after the one in flight."""
from __future__ import annotations

import threading
import time

import pytest

from deltafleet.serve.engine import Engine, SamplingParams
from deltafleet.serve.pacing import MIN_SAMPLES, WINDOW, StepClock, decode_kind
from deltafleet.serve.scheduler import END


def test_the_clock_waits_for_what_is_left_of_the_step_less_the_host_and_the_margins():
    """The device time is the median of a kind's last measurements (an outlier, a step that waited
    for a compile, moves it little), the host's the longest recent one; no wait before MIN_SAMPLES
    measurements of a kind, nor without the host's."""
    clock = StepClock(margin_s=0.001, margin_frac=0.1)
    kind = decode_kind(40, True)
    assert kind == (64, True) and decode_kind(1, False) == (1, False) and decode_kind(64, False) == (64, False)
    assert clock.slack(kind, 0.0) == 0.0  # no estimate: no wait
    for seconds in [0.010] * (MIN_SAMPLES - 1):
        clock.observe_device(kind, seconds)
    clock.observe_host(0.002)
    assert clock.slack(kind, 0.0) == 0.0  # too few measurements of the kind
    clock.observe_device(kind, 5.0)  # a step that waited for the host
    # median 0.010 (of 0.010, 0.010, 5.0): 0.010 · 0.9 − 0.002 run − 0.002 host − 0.001
    assert MIN_SAMPLES == 3 and clock.slack(kind, 0.002) == pytest.approx(0.004)
    clock.observe_host(0.003)
    clock.observe_host(0.001)
    assert clock.slack(kind, 0.002) == pytest.approx(0.003)  # the longest recent host time, 0.003
    assert clock.slack(kind, 0.008) == 0.0  # never negative
    assert clock.slack(decode_kind(40, False), 0.0) == 0.0  # another kind has no estimate
    for _ in range(WINDOW):
        clock.observe_device(kind, 0.030)
    assert clock.slack(kind, 0.0) == pytest.approx(0.030 * 0.9 - 0.003 - 0.001)  # the window moved on
    # a step with prefill chunks next: its own host estimate, none yet (no wait), then the longest
    assert clock.slack(kind, 0.0, prefill=True) == 0.0
    clock.observe_host(0.012, prefill=True)
    clock.observe_host(0.008, prefill=True)
    assert clock.slack(kind, 0.0, prefill=True) == pytest.approx(0.030 * 0.9 - 0.012 - 0.001)
    assert clock.slack(kind, 0.0) == pytest.approx(0.030 * 0.9 - 0.003 - 0.001)  # decode steps' unchanged


def _traced(tiny_family, wait_over: float):
    """A late-planning engine whose launches are listed (``(step index, prefills, time)``) and whose
    ``waiting`` event is set once the loop computes a decode-end wait over ``wait_over`` seconds."""
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=4,
                    late_planning=True)
    sch = engine.scheduler
    clock, runner = sch._clock, sch.runner
    assert clock is not None and clock.device == {}
    launched, waiting = [], threading.Event()
    real_execute, real_slack = runner.execute, clock.slack

    def execute(step, prev=None):
        launched.append((sch.steps, bool(step.chunks), time.perf_counter()))
        return real_execute(step, prev)

    def slack(kind, running_s, prefill=False):
        wait = real_slack(kind, running_s, prefill)
        if wait > wait_over and not prefill:
            waiting.set()
        return wait

    runner.execute, clock.slack = execute, slack
    return engine, sch, clock, launched, waiting


def test_a_request_arriving_while_the_loop_waits_joins_the_next_step(tiny_family):
    """The clock is told that a one-row base decode step runs 0.3 s on the device (off CUDA nothing
    is measured, so the loop waits only on what it is told): while the loop waits, a request is
    submitted, and its prompt is in the very next step launched, the one after the decode step in
    flight (without the wait, that step is planned at once)."""
    engine, sch, clock, launched, waiting = _traced(tiny_family, 0.1)
    a = engine.prepare("tiny", engine.encode_prompt("def "), SamplingParams(max_tokens=40, ignore_eos=True))
    out_a, _ = sch.submit(a)
    out_a.get(timeout=60)  # decoding: steps of one base row
    assert clock.host and clock.device == {}  # the host is timed; the device only on CUDA
    for _ in range(MIN_SAMPLES):
        clock.observe_device(decode_kind(1, False), 0.3)
    assert waiting.wait(30), "the loop never waited"
    n = sch.steps  # the step in flight is the last launched: the next one has index n
    b = engine.prepare("tiny-coder", engine.encode_prompt("The"), SamplingParams(max_tokens=3, temperature=0))
    out_b, _ = sch.submit(b)
    items = []
    while (item := out_b.get(timeout=60)) is not END:
        items.append(item)
    clock.device.clear()  # no more waits
    while out_a.get(timeout=60) is not END:
        pass
    first_prefill = next(i for i, prefills, _ in launched if i >= n and prefills)
    assert first_prefill == n and len(items) == 3
    assert clock.waited_s > 0.1
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app

    with TestClient(create_app(engine)) as tc:  # what /metrics tells of it
        samples = dict(line.rsplit(" ", 1) for line in tc.get("/metrics").text.splitlines()
                       if line and not line.startswith("#"))
    assert float(samples["deltafleet:late_planning_wait_seconds_total"]) == pytest.approx(sch.late_planning_wait_s)
    assert sch.late_planning_wait_s == clock.waited_s


def test_a_request_arriving_late_in_the_wait_ends_it_at_once(tiny_family):
    """Told that a one-row base decode step runs 2 s on the device, that a decode step's launch takes
    the host little and one with prefill chunks 1 s: with nobody waiting the loop waits until about
    0.2 s before the step's end; a request submitted 1.2 s into the wait, past the point where a
    prefill step must be launched, ends the wait at once, and its prompt is in the next step."""
    engine, sch, clock, launched, waiting = _traced(tiny_family, 1.0)
    a = engine.prepare("tiny", engine.encode_prompt("def "), SamplingParams(max_tokens=100, ignore_eos=True))
    out_a, _ = sch.submit(a)
    out_a.get(timeout=60)
    clock.host_prefill.extend([1.0] * WINDOW)  # a prefill step's launch: 1 s (more than any real one here)
    for _ in range(MIN_SAMPLES):
        clock.observe_device(decode_kind(1, False), 2.0)
    assert waiting.wait(30), "the loop never waited"
    t_wait = time.perf_counter()
    n = sch.steps
    time.sleep(1.2)  # past 2 · 0.9 − 1 − 0.0005 s into the wait, short of its decode end (≈ 1.8 s)
    b = engine.prepare("tiny-coder", engine.encode_prompt("The"), SamplingParams(max_tokens=2, temperature=0))
    t_submit = time.perf_counter()
    out_b, _ = sch.submit(b)
    while out_b.get(timeout=60) is not END:
        pass
    clock.device.clear()  # no more waits
    while out_a.get(timeout=60) is not END:
        pass
    step, _, t_launch = next(x for x in launched if x[0] >= n and x[1])
    assert step == n  # the step right after the one in flight
    assert t_launch - t_submit < 0.4, (t_launch - t_submit, t_submit - t_wait)  # not at the decode end, 0.6 s on


def test_the_late_planning_switch_is_checked(tiny_family):
    with pytest.raises(ValueError, match="late_planning must be true or false, got 'yes'"):
        Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", late_planning="yes")


def test_a_launch_that_waited_for_the_step_in_flight_is_not_the_hosts_time(tiny_family):
    """A step sampled under a grammar's mask is read before the next launch (its matcher needs the
    token): on a GPU that launch waits for the device, so it is not counted as the host's time to
    launch (it would hold the estimate, and so the waits, at about one step for 9 steps). Here every
    step of a structured request follows a masked one, but its first."""
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=4,
                    late_planning=True)
    clock, runner = engine.scheduler._clock, engine.scheduler.runner
    observed, launches = [], []
    real_observe, real_execute = clock.observe_host, runner.execute
    clock.observe_host = lambda seconds, prefill=False: observed.append(prefill) or real_observe(seconds, prefill)
    runner.execute = lambda step, prev=None: launches.append(bool(step.chunks)) or real_execute(step, prev)
    engine.complete("tiny", "def ", SamplingParams(max_tokens=6, temperature=0, constraint=("regex", "[a-z ]{60}")))
    assert launches == [True] + [False] * 5 and observed == [True]  # only the prefill, launched on an idle loop
    observed.clear()
    engine.complete("tiny", "def ", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert observed == [True] + [False] * 5  # without masks every launch is the host's
