"""The scheduler's waiting queue: requests in policy order, with O(1) removal from anywhere.

Aborting used to scan the queue once per request (a deque or a sorted list), so aborting all of
8k waiting requests took 1.2 s; here every operation is O(1), or O(log n) for the priority heap,
amortised, and removing all n items costs O(n) in total.

Items are opaque to the queue (the scheduler stores its `SequenceGroup`s, which are unhashable
dataclasses) and are identified by identity, `id(item)`. The queue holds a reference to each item
it contains, so an id cannot be reused by another object while its item is queued. An item is in
a queue at most once.

    FCFS       an insertion-ordered dict  id -> item      add: back; prepend: front
    priority   a heap of (key, seq_no, item), lazy deletion; a dict id -> seq_no of live entries

`prepend` is for a preempted request, which keeps its place ahead of newer arrivals: FCFS puts it
at the very front; priority puts it ahead of the items with an equal key (as `bisect.insort_left`
would), while `add` puts a new item behind them (as `bisect.insort`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from tessera.config import SchedulingPolicy

T = TypeVar("T")


class RequestQueue(ABC, Generic[T]):
    """Waiting requests in policy order. `peek`/`pop` on an empty queue raise IndexError;
    `add`/`prepend` of an item already queued raise ValueError; `remove` of an absent item raises
    KeyError. Iteration walks a snapshot, so the queue may be changed while iterating."""

    @abstractmethod
    def add(self, item: T) -> None:
        """A new arrival, placed in policy order (behind items that compare equal)."""

    @abstractmethod
    def prepend(self, item: T) -> None:
        """A preempted request: placed ahead of newer arrivals (see the module docstring)."""

    @abstractmethod
    def peek(self) -> T:
        """The item `pop` would return, left in the queue."""

    @abstractmethod
    def pop(self) -> T:
        """Remove and return the first item in policy order."""

    @abstractmethod
    def remove(self, item: T) -> None:
        """Remove `item` from wherever it is; KeyError if it is not queued."""

    def remove_many(self, items: Iterable[T]) -> list[T]:
        """Remove those of `items` that are queued, ignoring the rest (an abort may name requests
        that are running or finished). Returns the removed items, in the order given."""
        removed = []
        for item in items:
            if item in self:
                self.remove(item)
                removed.append(item)
        return removed

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[T]:
        """The queued items in policy order."""

    @abstractmethod
    def __contains__(self, item: object) -> bool: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self)})"


class FCFSRequestQueue(RequestQueue[T]):
    """First come, first served: arrival order, preempted requests at the front."""

    def __init__(self) -> None:
        self._items: OrderedDict[int, T] = OrderedDict()  # id(item) -> item, front first

    def add(self, item: T) -> None:
        if id(item) in self._items:
            raise ValueError(f"{item!r} is already queued")
        self._items[id(item)] = item

    def prepend(self, item: T) -> None:
        self.add(item)
        self._items.move_to_end(id(item), last=False)

    def peek(self) -> T:
        if not self._items:
            raise IndexError("peek from an empty request queue")
        return next(iter(self._items.values()))

    def pop(self) -> T:
        if not self._items:
            raise IndexError("pop from an empty request queue")
        return self._items.popitem(last=False)[1]

    def remove(self, item: T) -> None:
        if self._items.get(id(item)) is not item:
            raise KeyError(f"{item!r} is not queued")
        del self._items[id(item)]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __contains__(self, item: object) -> bool:
        return self._items.get(id(item)) is item


class PriorityRequestQueue(RequestQueue[T]):
    """Lowest `key(item)` first, e.g. (priority, arrival_time). The key is read once, when the
    item is queued. Ties: prepended items first (the latest prepend leading), then added items in
    the order they were added."""

    def __init__(self, key: Callable[[T], Any]) -> None:
        self._key = key
        # (key, seq_no, item). seq_no is unique (adds count up from 0, prepends down from -1), so
        # tuples never compare items. An entry is live iff _live[id(item)] == its seq_no; removed
        # entries stay in the heap as tombstones until they reach the top or the heap is rebuilt.
        self._heap: list[tuple[Any, int, T]] = []
        self._live: dict[int, int] = {}
        self._next_add = itertools.count(0)
        self._next_prepend = itertools.count(-1, -1)

    def _push(self, item: T, seq_no: int) -> None:
        if id(item) in self._live:
            raise ValueError(f"{item!r} is already queued")
        self._live[id(item)] = seq_no
        heapq.heappush(self._heap, (self._key(item), seq_no, item))

    def add(self, item: T) -> None:
        self._push(item, next(self._next_add))

    def prepend(self, item: T) -> None:
        self._push(item, next(self._next_prepend))

    def _drop_dead_top(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(id(heap[0][2])) != heap[0][1]:
            heapq.heappop(heap)

    def peek(self) -> T:
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][2]

    def pop(self) -> T:
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        _, _, item = heapq.heappop(self._heap)
        del self._live[id(item)]
        return item

    def remove(self, item: T) -> None:
        if id(item) not in self._live:
            raise KeyError(f"{item!r} is not queued")
        del self._live[id(item)]
        # Rebuild once tombstones outnumber live entries: O(n) after >= n/2 removals, so O(1)
        # amortised, and the heap never holds more than twice the live items (plus one).
        if len(self._heap) > 2 * len(self._live) + 1:
            live = self._live
            self._heap = [e for e in self._heap if live.get(id(e[2])) == e[1]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[T]:
        live = self._live
        entries = sorted(e for e in self._heap if live.get(id(e[2])) == e[1])
        return iter([item for _, _, item in entries])

    def __contains__(self, item: object) -> bool:
        return id(item) in self._live


def _priority_key(group: Any) -> tuple[int, float]:
    return (group.priority, group.arrival_time)


def create_request_queue(
    policy: SchedulingPolicy | str, key: Callable[[Any], Any] = _priority_key
) -> RequestQueue[Any]:
    """The waiting queue for `policy` ("fcfs" | "priority", or the enum). The priority queue
    orders by `key`, by default (item.priority, item.arrival_time); FCFS ignores it."""
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue(key)
    return FCFSRequestQueue()
