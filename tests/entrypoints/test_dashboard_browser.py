"""The dashboard in a real browser: Debian's headless chromium driven by Playwright (no browser
download; `apt-get install -y chromium`, `pip install playwright`). `make test-browser` runs it.

1. `tessera serve` (the default model) under a load of more requests than seats: the page's
   queue counts and block map change while it runs; a screenshot is saved.
2. `tessera simulate --dashboard-file`: the replay's first and last frames differ as the run
   did (a busy cache, then an empty one), and play advances the frames.

Set TESSERA_DASHBOARD_SCREENSHOT=PATH to keep the screenshot under load (docs/dashboard.png).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from .conftest import ServerProcess

pytestmark = pytest.mark.heavy

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "sk-browser"

STATE_JS = """() => ({
  waiting: Number(document.getElementById('q-waiting').textContent),
  running: Number(document.getElementById('q-running').textContent),
  swapped: Number(document.getElementById('q-swapped').textContent),
  blocks: document.getElementById('kv-map').dataset.signature || '',
  used: Number(document.getElementById('kv-map').dataset.used || -1),
  seq: document.body.dataset.seq || '',
})"""


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return page, errors


def _load(url: str, prompts: list[str], results: list[int]) -> None:
    def one(prompt: str) -> None:
        r = httpx.post(url + "/v1/completions", timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                             "temperature": 0})
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_live_page_follows_a_loaded_server(browser, tmp_path):
    server = ServerProcess("--api-key", KEY, "--max-num-seqs", "4", "--max-model-len", "512",
                           "--num-gpu-blocks-override", "80", "--dashboard-interval", "100")
    try:
        page, errors = _page(browser)
        page.goto(f"{server.url}/dashboard?api_key={KEY}")
        page.wait_for_function("document.body.dataset.seq", timeout=30_000)
        idle = page.evaluate(STATE_JS)
        assert (idle["waiting"], idle["running"], idle["used"]) == (0, 0, 0)
        prompts = [f"Request {k}: " + "the quick brown fox jumps over the lazy dog " * (4 + 2 * k)
                   for k in range(8)]
        results: list[int] = []
        load = threading.Thread(target=_load, args=(server.url, prompts, results))
        load.start()
        states, shot = [], None
        while load.is_alive():
            state = page.evaluate(STATE_JS)
            states.append(state)
            if shot is None and state["waiting"] > 0 and state["running"] >= 3:
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                keep = os.environ.get("TESSERA_DASHBOARD_SCREENSHOT")
                if keep:
                    shutil.copyfile(shot, keep)
            time.sleep(0.1)
        load.join()
        assert results == [200] * len(prompts)
        page.wait_for_function("Number(document.getElementById('q-running').textContent) === 0",
                               timeout=30_000)
        assert max(s["waiting"] for s in states) > 0  # more requests than seats
        assert max(s["running"] for s in states) == 4
        assert len({s["blocks"] for s in states}) >= 3  # the block map moved
        assert max(s["used"] for s in states) > 0 and page.evaluate(STATE_JS)["used"] == 0
        assert shot is not None and shot.stat().st_size > 10_000
        assert "Request 1" not in page.content()  # ids and counts, never the prompt
        assert not errors, errors
    finally:
        server.stop()


def test_simulation_replay_first_and_last_frames(browser, tmp_path):
    from tessera.entrypoints.cli import main

    html = tmp_path / "run.html"
    assert main(["simulate", "--dataset", "random", "--num-prompts", "60", "--request-rate",
                 "12", "--random-input-len", "512", "--random-output-len", "64",
                 "--kv-cache-space", "1", "--max-num-seqs", "16", "--seed", "1", "--quiet",
                 "--dashboard-file", str(html)]) == 0
    page, errors = _page(browser)
    page.goto(html.as_uri())
    count = page.evaluate("window.tesseraDashboard.count")
    assert count > 10
    page.evaluate("window.tesseraDashboard.show(0)")
    first = page.evaluate(STATE_JS)
    first_png = page.locator("main").screenshot()
    page.evaluate(f"window.tesseraDashboard.show({count - 1})")
    last = page.evaluate(STATE_JS)
    last_png = page.locator("main").screenshot()
    assert first["running"] > 0 and first["used"] > 0
    assert (last["waiting"], last["running"], last["swapped"], last["used"]) == (0, 0, 0, 0)
    assert first["blocks"] != last["blocks"] and first_png != last_png
    # the slider and play/pause drive the frames
    page.locator("#slider").fill("0")
    page.click("#play")
    page.wait_for_function("Number(document.body.dataset.frame) >= 3", timeout=10_000)
    page.click("#play")
    assert page.inner_text("#play") == "Play"
    assert not errors, errors
