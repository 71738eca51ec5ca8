"""The dashboard page: one HTML file with its CSS and JavaScript inlined (tessera/engine/dashboard/
static/, shipped in the package: no build step, no CDN, nothing fetched but the event stream).

The same page serves both modes, chosen by the boot JSON it embeds:
- live (`GET /dashboard`): it opens `GET /dashboard/events` and renders each sample;
- replay (`tessera simulate --dashboard-file`): it carries every frame and renders the one the
  slider points at (play/pause steps through them).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def render_page(boot: dict[str, Any]) -> str:
    """The page with `boot` embedded as JSON (safe inside <script>: no `</` survives)."""
    data = json.dumps(boot, separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = _asset("dashboard.html")
    # the data goes in last, so no text in it is ever taken for a marker
    page = page.replace("/*TESSERA_CSS*/", _asset("dashboard.css"), 1)
    page = page.replace("/*TESSERA_JS*/", _asset("dashboard.js"), 1)
    return page.replace("/*TESSERA_BOOT*/", data, 1)


def live_page(events_path: str, interval_ms: int) -> str:
    """The page a server sends: it reads `events_path` (relative to the page's own URL)."""
    return render_page({"mode": "live", "events": events_path, "interval_ms": interval_ms})


def replay_page(frames: list[dict[str, Any]], title: str, interval_ms: int) -> str:
    """A self-contained replay of `frames` (samples on the simulator's virtual clock)."""
    return render_page({"mode": "replay", "title": title, "interval_ms": interval_ms,
                        "frames": frames})
