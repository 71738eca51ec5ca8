"""The control channel: rank 0 broadcasts each message (a pickled `SchedulerOutput`, or a
control command) to every other rank, over a gloo group on CPU.

Why torch.distributed and not a pipe per worker: the same channel reaches ranks on other nodes
(they joined the same group through --distributed-init-method), so there is one code path for
one machine and many. Measured against a multiprocessing pipe and pyzmq PUB/SUB in
benchmarks/tensor_parallel.py (the channel section); see docs/tensor_parallel.md.

One broadcast of a fixed buffer carries the length and the first `capacity` bytes, so a message
that fits (a decode step of a few dozen requests) costs one collective; a larger one (a batch of
new prompts) costs a second broadcast of the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_HEADER = 8  # little-endian int64: the message length


class BroadcastChannel:
    def __init__(self, group, capacity: int = 16 << 10):
        self.group = group
        self.buf = torch.zeros(capacity, dtype=torch.uint8)
        self.capacity = capacity - _HEADER

    def send_bytes(self, data: bytes) -> None:
        """Rank 0: hand `data` to every rank (blocks until the broadcast completed)."""
        n = len(data)
        first = min(n, self.capacity)
        self.buf[:_HEADER] = torch.frombuffer(bytearray(n.to_bytes(_HEADER, "little")),
                                              dtype=torch.uint8)
        if first:
            self.buf[_HEADER : _HEADER + first] = torch.frombuffer(bytearray(data[:first]),
                                                                   dtype=torch.uint8)
        dist.broadcast(self.buf, src=0, group=self.group)
        if n > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def recv_bytes(self) -> bytes:
        """Ranks > 0: the next message rank 0 sent."""
        dist.broadcast(self.buf, src=0, group=self.group)
        n = int.from_bytes(self.buf[:_HEADER].numpy().tobytes(), "little")
        first = min(n, self.capacity)
        data = self.buf[_HEADER : _HEADER + first].numpy().tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return data
