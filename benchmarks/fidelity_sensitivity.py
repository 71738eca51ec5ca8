"""`simulator_fidelity.py --sensitivity`: each setting simulated again with every step priced a
few percent off, to show how far a setting's medians move for a small error of the step prices
(the real runs' own steps drift by more than that between rounds on this machine)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from tessera.simulator.cost_model import SERVING_FEATURES

SCALES = (0.94, 0.97, 1.03, 1.06)
KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "num_preemptions")


def scaled_profile(profile: dict, scale: float) -> dict:
    """`profile` with every step priced `scale` times: the runner's coefficients, the swap rate
    and the serving terms (the latency outside the engine is no step's and stays)."""
    out = dict(profile)
    out["coefficients"] = {k: v * scale for k, v in profile["coefficients"].items()}
    out["swap_s_per_byte"] = profile["swap_s_per_byte"] * scale
    for key, _ in SERVING_FEATURES:
        if key in profile:
            out[key] = profile[key] * scale
    return out


def sensitivity(profile_path: str, settings: list[str], work: str,
                simulate: Callable[[str, str], dict]) -> dict[str, dict[str, dict]]:
    """setting -> str(scale) -> KEYS of `simulate(setting, scaled profile path)`'s metrics."""
    with open(profile_path, encoding="utf-8") as f:
        fitted = json.load(f)
    out: dict[str, dict[str, dict]] = {name: {} for name in settings}
    for scale in SCALES:
        path = os.path.join(work, f"profile-x{scale}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(scaled_profile(fitted, scale), f)
        for name in settings:
            metrics = simulate(name, path)
            out[name][str(scale)] = {key: metrics[key] for key in KEYS}
    return out


def format_sensitivity(rows: dict[str, dict]) -> str:
    """The table: per setting, simulated median TTFT / median TPOT / preemptions at each scale
    (x1.0: the row's own simulation)."""
    scales = (*SCALES[:2], 1.0, *SCALES[2:])
    lines = ["sensitivity: the simulated medians with every step priced xS (TTFT ms / TPOT ms / "
             "preemptions); x1.0 is the table above",
             f"{'setting':<10} " + " ".join(f"{'x' + str(sc):>18}" for sc in scales)]
    for name, row in rows.items():
        cells = []
        for sc in scales:
            m = row["sim"] if sc == 1.0 else row["sensitivity"][str(sc)]
            cells.append(f"{m['median_ttft_ms']:6.0f}/{m['median_tpot_ms']:5.2f}/"
                         f"{m['num_preemptions']:<3d}")
        lines.append(f"{name:<10} " + " ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)
