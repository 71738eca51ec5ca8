"""The `isa` fixture: a kernel test that uses it runs once for every instruction set this CPU can
execute (tessera/kernels/build.py: avx512, avx2, portable), each on its own build. With
TESSERA_CPU_ISA set when the tests start, only that one runs."""

from __future__ import annotations

import os

import pytest

from tessera.kernels import build

_FORCED = os.environ.get("TESSERA_CPU_ISA", "").strip().lower()
ISAS = [_FORCED] if _FORCED else build.supported_isas()


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch) -> str:
    """TESSERA_CPU_ISA for the test's duration; kernels loaded inside it are that ISA's build."""
    monkeypatch.setenv("TESSERA_CPU_ISA", request.param)
    return request.param
