"""The server's allocator settings (tessera/engine/malloc_tuning.py): a step's large buffers are
reused from the heap, not mapped afresh (and faulted in page by page) on every allocation."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh process (mallopt is process-wide): apply the server's settings, then allocate, touch
# and free a 4 MiB buffer again and again, as a prefill step does with its activations in every
# layer; print the minor page faults of 20 rounds once the heap has grown to hold it (glibc takes
# a few rounds to settle: 6 here, with the settings and without).
PROBE = """
import resource, sys, torch
from tessera.engine.malloc_tuning import limit_malloc_retention
if not limit_malloc_retention():
    print("unsupported"); sys.exit(0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(1 << 20).fill_(1.0)
before = faults()
for _ in range(20):
    torch.empty(1 << 20).fill_(1.0)  # 4 MiB of float32
print(faults() - before)
"""


def test_step_sized_buffers_do_not_fault_in_on_every_allocation():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()[-1]
    if out == "unsupported":
        pytest.skip("not glibc: the allocator keeps its defaults")
    # a fresh mapping each time (the old fixed 1 MiB mmap threshold) faults in all 1024 pages of
    # 4 KiB every time: 20,480 faults
    assert int(out) < 1024, f"{out} minor faults for 20 reused 4 MiB buffers"

