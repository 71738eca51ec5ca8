"""`tessera simulate --dashboard-file run.html`: the live dashboard's samples taken on the virtual
clock, written into one self-contained page that replays them (slider, play/pause).

The frames are what `GET /dashboard/events` sends a browser (tessera/engine/dashboard): the same
recorder over the simulator's scheduler, the same rolling rates, the same page. A frame is taken
at the end of the first step at least `interval_s` (virtual) after the previous one. A long
simulation would make a huge file, so past `max_frames` every other frame is dropped (its steps
move into the next frame kept) and the interval doubles; the last step always gets a frame.
"""

from __future__ import annotations

from typing import Any

from tessera.core.core_output import EngineCoreOutput
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.engine.dashboard.page import replay_page
from tessera.engine.dashboard.rates import RollingRates
from tessera.engine.dashboard.snapshot import MAX_STEPS, DashboardRecorder

DEFAULT_INTERVAL_S = 0.25
DEFAULT_MAX_FRAMES = 400


class DashboardFrames:
    """A `StepObserver` of `Simulator.run` that keeps the dashboard's frames."""

    def __init__(self, scheduler: Scheduler, model_name: str = "simulated",
                 interval_s: float = DEFAULT_INTERVAL_S,
                 max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        if interval_s <= 0 or max_frames < 2:
            raise ValueError(f"interval_s must be > 0 and max_frames >= 2, got {interval_s}, "
                             f"{max_frames}")
        self.scheduler = scheduler
        self.recorder = DashboardRecorder(scheduler, model_name)
        self.recorder.active = True
        self.rates = RollingRates()
        self.interval_s = interval_s
        self.max_frames = max_frames
        self.frames: list[dict[str, Any]] = []
        self._next = -float("inf")
        self._last_end: float | None = None
        self._accepted = scheduler.stats().num_spec_accepted_tokens_total
        self._num_tokens: dict[str, int] = {}  # request id -> tokens so far (all its sequences)

    def on_step(self, out: SchedulerOutput, core_outputs: list[EngineCoreOutput], start: float,
                end: float) -> None:
        accepted = self.scheduler.stats().num_spec_accepted_tokens_total
        self.recorder.record_step(out, start, end, accepted - self._accepted)
        self._accepted = accepted
        counts = self._num_tokens
        for core in core_outputs:
            n = sum(len(d.new_token_ids) for d in core.seqs)
            if n:
                counts[core.request_id] = counts.get(core.request_id, 0) + n
            if core.finished:
                self._finished(core, counts.pop(core.request_id, 0))
        self._last_end = end
        if end >= self._next:
            self._take(end)

    def _finished(self, core: EngineCoreOutput, num_tokens: int) -> None:
        m = core.metrics
        if core.error is not None or m is None or m.first_token_time is None:
            return
        last = m.last_token_time or m.first_token_time
        # the simulator's requests are single sequences (bench serve's), so these are its tokens
        tpot = (last - m.first_token_time) / (num_tokens - 1) if num_tokens > 1 else None
        self.rates.observe_finished(m.finished_time or last, m.first_token_time - m.arrival_time,
                                    tpot)

    def _take(self, now: float) -> None:
        frame = self.recorder.snapshot(now)
        frame["rates"] = self.rates.rates(now, frame["counters"])
        self.frames.append(frame)
        self._next = now + self.interval_s
        if len(self.frames) > self.max_frames:
            self._thin()

    def _thin(self) -> None:
        """Keep every other frame, counted from the last; a dropped frame's steps go into the
        frame after it."""
        kept: list[dict[str, Any]] = []
        frames = self.frames
        for i in range(len(frames) - 1, -1, -2):
            frame = frames[i]
            if i > 0:
                frame["steps"] = (frames[i - 1]["steps"] + frame["steps"])[-MAX_STEPS:]
            kept.append(frame)
        self.frames = kept[::-1]
        self.interval_s *= 2

    def finish(self) -> list[dict[str, Any]]:
        """The frames, with one at the last step if it has none yet."""
        if self._last_end is not None and (not self.frames
                                           or self.frames[-1]["time"] < self._last_end):
            self._take(self._last_end)
        return self.frames


def write_dashboard(path: str, frames: list[dict[str, Any]], title: str,
                    interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """The replay page of `frames` at `path` (UTF-8 HTML, nothing to fetch)."""
    if not frames:
        raise ValueError("--dashboard-file: the simulation ran no step, so there is nothing "
                         "to show")
    with open(path, "w", encoding="utf-8") as f:
        f.write(replay_page(frames, title, round(1e3 * interval_s)))
