"""RequestQueue against a naive list model (hypothesis state machine), and a deterministic check
that removing every queued item costs linear, not quadratic, work."""

from __future__ import annotations

import bisect
import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera.config import SchedulingPolicy
from tessera.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)

_ids = itertools.count()


class Req:
    """A stand-in request. Every Req compares equal to every other one (and is unhashable, like
    the dataclass SequenceGroup), so a queue that tracked items by equality would mix them up."""

    def __init__(self, priority: int = 0, arrival_time: float = 0.0) -> None:
        self.request_id = f"r{next(_ids)}"
        self.priority = priority
        self.arrival_time = arrival_time

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Req)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Req({self.request_id}, {self.priority}, {self.arrival_time})"


def key(r: Req) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


class Model:
    """The naive reference: a list in policy order, every operation a linear scan."""

    def __init__(self, priority: bool) -> None:
        self.items: list[Req] = []
        self.priority = priority

    def add(self, r: Req) -> None:
        if self.priority:
            bisect.insort(self.items, r, key=key)  # behind equal keys
        else:
            self.items.append(r)

    def prepend(self, r: Req) -> None:
        if self.priority:
            bisect.insort_left(self.items, r, key=key)  # ahead of equal keys
        else:
            self.items.insert(0, r)

    def index(self, r: Req) -> int:
        return next(i for i, x in enumerate(self.items) if x is r)


class QueueMachine(RuleBasedStateMachine):
    priority = False

    def __init__(self) -> None:
        super().__init__()
        policy = "priority" if self.priority else "fcfs"
        self.queue: RequestQueue[Req] = create_request_queue(policy)
        self.model = Model(self.priority)
        self.out: list[Req] = []  # popped or removed: candidates for prepend / re-add

    # small ranges force ties on both key fields
    @rule(priority=st.integers(0, 2), arrival=st.integers(0, 3))
    def add_new(self, priority: int, arrival: int) -> None:
        r = Req(priority, float(arrival))
        self.queue.add(r)
        self.model.add(r)

    @precondition(lambda self: self.out)
    @rule(data=st.data(), front=st.booleans())
    def requeue(self, data: st.DataObject, front: bool) -> None:
        r = self.out.pop(data.draw(st.integers(0, len(self.out) - 1)))
        if front:
            self.queue.prepend(r)
            self.model.prepend(r)
        else:
            self.queue.add(r)
            self.model.add(r)

    @rule()
    def pop(self) -> None:
        if not self.model.items:
            with pytest.raises(IndexError):
                self.queue.pop()
            return
        r = self.queue.pop()
        assert r is self.model.items.pop(0)
        self.out.append(r)

    @rule()
    def peek(self) -> None:
        if not self.model.items:
            with pytest.raises(IndexError):
                self.queue.peek()
            return
        assert self.queue.peek() is self.model.items[0]

    @precondition(lambda self: self.model.items)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.model.items))
        self.queue.remove(r)
        del self.model.items[self.model.index(r)]
        self.out.append(r)
        with pytest.raises(KeyError):
            self.queue.remove(r)

    @rule(data=st.data())
    def remove_many(self, data: st.DataObject) -> None:
        pool = self.model.items + self.out + [Req()]
        picked = data.draw(st.lists(st.sampled_from(pool), max_size=6, unique_by=id))
        expected = [r for r in picked if any(x is r for x in self.model.items)]
        removed = self.queue.remove_many(picked)
        assert [id(r) for r in removed] == [id(r) for r in expected]
        for r in expected:
            del self.model.items[self.model.index(r)]
            self.out.append(r)

    @precondition(lambda self: self.model.items)
    @rule(data=st.data())
    def add_twice_is_refused(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.model.items))
        with pytest.raises(ValueError):
            self.queue.add(r)
        with pytest.raises(ValueError):
            self.queue.prepend(r)

    @invariant()
    def same_as_model(self) -> None:
        assert [id(r) for r in self.queue] == [id(r) for r in self.model.items]
        assert len(self.queue) == len(self.model.items)
        assert bool(self.queue) == bool(self.model.items)
        assert all(r in self.queue for r in self.model.items)
        assert not any(r in self.queue for r in self.out)


class PriorityQueueMachine(QueueMachine):
    priority = True


TestFCFSQueue = QueueMachine.TestCase
TestPriorityQueue = PriorityQueueMachine.TestCase
for _case in (TestFCFSQueue, TestPriorityQueue):
    _case.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_factory_accepts_string_and_enum():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")


def test_iteration_is_a_snapshot():
    for policy in ("fcfs", "priority"):
        q = create_request_queue(policy)
        items = [Req(0, float(i)) for i in range(5)]
        for r in items:
            q.add(r)
        for r in q:  # removing while iterating is allowed
            q.remove(r)
        assert not q and list(q) == []


# Linear removal, checked by counting work, not by timing (which flakes on shared cores).


class CountingKey:
    """A priority key that counts every comparison made on it."""

    count = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        CountingKey.count += 1
        return isinstance(other, CountingKey) and self.value == other.value

    def __lt__(self, other: CountingKey) -> bool:
        CountingKey.count += 1
        return self.value < other.value


class CountingReq(Req):
    """Counts equality tests: a queue that finds an item by scanning (deque.remove, list.index)
    makes O(n) of them per removal."""

    count = 0

    def __eq__(self, other: object) -> bool:
        CountingReq.count += 1
        return other is self

    __hash__ = None  # type: ignore[assignment]


def removal_work(policy: str, n: int) -> int:
    q = create_request_queue(policy, key=lambda r: CountingKey(r.priority))
    items = [CountingReq(priority=(i * 7919) % 97, arrival_time=float(i)) for i in range(n)]
    for r in items:
        q.add(r)
    CountingKey.count = CountingReq.count = 0
    order = items[1::2] + items[::2]  # out of queue order, half through remove_many
    q.remove_many(order[: n // 2])
    for r in order[n // 2 :]:
        q.remove(r)
    assert not q
    return CountingKey.count + CountingReq.count


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_removing_everything_is_linear(policy: str):
    small, large = removal_work(policy, 2000), removal_work(policy, 8000)
    # linear work grows 4x from 2k to 8k items; a scan per removal would grow 16x
    assert large <= 8 * 8000
    assert large <= 5 * max(small, 1)
