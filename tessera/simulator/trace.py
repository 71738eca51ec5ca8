"""A step log (tessera/engine/step_log.py, `tessera serve --step-log FILE`) read back: the trace a
replay resends (arrivals, the tokens each stream produced, where it ended, aborts) and the
schedule it is held to (the logged steps and their times).

A step's time, for the simulator's clock, runs from its start to the next step's start while the
engine stayed busy (the next step began at once, so the gap between them is part of the step's
cost), and to its own end when the engine went idle after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.engine.step_log import FORMAT, FORMAT_VERSION


@dataclass(frozen=True)
class Arrival:
    time: float  # the scheduler took it (log clock)
    arrival_time: float  # the server received it
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int | None
    n: int
    priority: int
    prompt_logprobs: bool


@dataclass(frozen=True)
class Step:
    index: int
    start: float
    end: float
    busy: bool  # the engine had work left after it
    seconds: float  # the simulator's price of it (see the module docstring)
    reqs: list[tuple[str, int, int]]  # (req_id, new tokens, computed before)
    preempted: list[str]
    swap_blocks: int
    tokens: dict[str, list[int]]
    finished: dict[str, int]
    # of the KV tokens its streams read, those in blocks another of them reads too (0 in a log
    # written before the step log carried it)
    num_shared_context_tokens: int = 0

    def schedule(self) -> tuple[list[tuple[str, int, int]], list[str]]:
        """What a replay must reproduce: the sorted (req_id, new, computed) and preemptions."""
        return sorted(self.reqs), sorted(self.preempted)


@dataclass
class Trace:
    path: str
    header: dict
    arrivals: list[Arrival] = field(default_factory=list)
    aborts: list[tuple[float, list[str]]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        return int(self.header.get("block_bytes") or 0)

    def scheduler_config(self) -> SchedulerConfig:
        s = dict(self.header["scheduler"])
        s["preemption_mode"] = (PreemptionMode(s["preemption_mode"])
                                if s["preemption_mode"] else None)
        s["scheduling_policy"] = SchedulingPolicy(s["scheduling_policy"])
        return SchedulerConfig(**s)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(**self.header["cache"])

    def output_tokens(self) -> dict[str, list[int]]:
        """Every stream's tokens in the order it gained them."""
        out: dict[str, list[int]] = {}
        for step in self.steps:
            for req_id, ids in step.tokens.items():
                out.setdefault(req_id, []).extend(ids)
        return out

    def final_lengths(self) -> dict[str, int]:
        """req_id -> output length of every stream that finished in the log."""
        return {r: n for step in self.steps for r, n in step.finished.items()}


def read_trace(path: str) -> Trace:
    """Parse a step log; ValueError naming the file and line when it is not one."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
        raise ValueError(f"--replay {path}: not a step log (line {e.lineno}: {e.msg})") from None
    if not records or records[0].get("type") != "header" or records[0].get("format") != FORMAT:
        raise ValueError(f"--replay {path}: not a step log (no {FORMAT} header on its first "
                         "line; write one with `tessera serve --step-log FILE`)")
    if records[0].get("version") != FORMAT_VERSION:
        raise ValueError(f"--replay {path}: step log version {records[0].get('version')}, this "
                         f"tessera reads version {FORMAT_VERSION}")
    trace = Trace(path, records[0])
    steps = [r for r in records if r.get("type") == "step"]
    try:
        for r in records:
            if r.get("type") == "arrival":
                trace.arrivals.append(Arrival(
                    r["time"], r["arrival_time"], r["request_id"], list(r["prompt_token_ids"]),
                    r["max_tokens"], int(r["n"]), int(r["priority"]), bool(r["prompt_logprobs"])))
            elif r.get("type") == "abort":
                trace.aborts.append((r["time"], list(r["request_ids"])))
        for i, r in enumerate(steps):
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            end = nxt["start"] if r["busy"] and nxt is not None else r["end"]
            trace.steps.append(Step(
                r["step"], r["start"], r["end"], bool(r["busy"]), end - r["start"],
                [(str(q), int(n), int(c)) for q, n, c in r["reqs"]], list(r["preempted"]),
                int(r["swap_out"]) + int(r["swap_in"]), r["tokens"],
                {k: int(v) for k, v in r["finished"].items()},
                int(r.get("num_shared_context_tokens", 0))))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--replay {path}: a malformed record ({type(e).__name__}: {e})") from None
    return trace
