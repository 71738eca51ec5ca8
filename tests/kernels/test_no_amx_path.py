"""On an AMX machine the bf16 kernels (linears, paged attention) run AMX tiles, so the vector paths
that CPUs without AMX (Zen4) run would go untested here. Re-run the bf16 kernel tests in a child
process with TESSERA_DISABLE_AMX=1 (read once per process by linear_amx.h)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cpu_has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_amx(), reason="no AMX: the default run already takes this path")
def test_bf16_kernels_without_amx():
    # the AVX-512 build only: the avx2 and portable builds never use AMX
    env = dict(os.environ, TESSERA_DISABLE_AMX="1", PYTHONPATH=str(ROOT), TESSERA_CPU_ISA="avx512")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "tests/kernels/test_linear_kernel.py", "tests/kernels/test_quant_linear_kernel.py",
           "tests/kernels/test_quant_int8_kernel.py",
           "tests/kernels/test_paged_attention_kernel.py"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
