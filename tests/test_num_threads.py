"""--num-threads: the threads of torch and the C++ kernels, default the process's own cores."""

from __future__ import annotations

import os

import pytest

from tessera.config import EngineArgs, ParallelConfig


def test_default_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert EngineArgs().create_engine_config().parallel.threads_per_node == 3


def test_flag_overrides_and_is_validated():
    assert EngineArgs(num_threads=3).create_engine_config().parallel.threads_per_node == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="--num-threads"):
            ParallelConfig(num_threads=bad)


def test_load_bundle_sets_torch_threads(monkeypatch, default_model_path):
    """The engine's process runs on --num-threads (here 1, then the default)."""
    import torch

    from tessera.engine import loading

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(loading, "load_model", _stop)
    for args, expected in ((EngineArgs(num_threads=1), 1),
                           (EngineArgs(), len(os.sched_getaffinity(0)))):
        with pytest.raises(_Stop):
            loading.load_bundle(args)
        assert seen[-1] == expected


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop
