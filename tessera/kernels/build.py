"""Just-in-time builds of the C++ kernels, shared by every kernel module.

`torch.utils.cpp_extension.load` compiles a source the first time it is asked for (~30-60 s, once
per machine: the build is cached under `$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions).
It needs a C++ compiler and `ninja`. A failed build is logged once and reported as None, so callers
fall back to their torch path; `TESSERA_DISABLE_CPP_KERNELS=1` forces that fallback.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_built: dict[str, ModuleType | None] = {}


def load_extension(name: str, source: Path) -> ModuleType | None:
    """The compiled module for `source` (built once per process), or None if it cannot be built."""
    if name in _built:
        return _built[name]
    module = None
    if not os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
        try:
            from torch.utils.cpp_extension import load

            module = load(
                name=name,
                sources=[str(source)],
                # -march=native: the build is cached per machine; CI runs on the same CPU type.
                # -fopenmp: at::parallel_for in the kernels is an OpenMP loop; without it it runs
                # on one thread.
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # compiler, ninja or header problems: run on the torch path instead
            logger.warning("C++ kernel %s unavailable, using the torch fallback: %s", name, e)
    _built[name] = module
    return module
