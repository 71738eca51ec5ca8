"""The `isa` fixture: a kernel test that uses it runs once for every instruction set this CPU can
execute (tessera/kernels/build.py: avx512, avx2, portable), each on its own build."""

from __future__ import annotations

import pytest

from tessera.kernels import build


@pytest.fixture(params=build.supported_isas())
def isa(request, monkeypatch) -> str:
    """TESSERA_CPU_ISA for the test's duration; kernels loaded inside it are that ISA's build."""
    monkeypatch.setenv("TESSERA_CPU_ISA", request.param)
    return request.param
