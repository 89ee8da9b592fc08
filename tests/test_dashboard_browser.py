"""The dashboard in a real browser: Debian's headless Chromium, driven by playwright-python.

The server runs on the embedded model; the test sends a few requests, then checks in the page
that every chart has drawn non-zero data (each canvas reports the points and the largest value
it drew, and the canvas pixels hold the line colour) and that the tiles show numbers. It saves a
screenshot to ``loadtests/results/dashboard.png``. Skipped only when Chromium is not installed
(``make test`` installs it with apt where it can).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.real_model

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = Path(__file__).resolve().parent.parent / "loadtests" / "results" / "dashboard.png"
CHARTS = ["request_rate", "tokens", "ttft", "itl", "e2e", "per_pass", "drafts", "queue"]

# Pixels of the first series colour (#2f6fdb) in a canvas: proof that a line was drawn, not only axes.
COUNT_LINE_PIXELS = """(id) => {
  const c = document.getElementById(id);
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (Math.abs(d[i] - 0x2f) < 40 && Math.abs(d[i + 1] - 0x6f) < 40 && Math.abs(d[i + 2] - 0xdb) < 40 && d[i + 3] > 200) n++;
  return n;
}"""


@pytest.fixture(scope="module")
def dashboard_server(embedded_engine):
    running = start_server(embedded_engine)
    yield running
    running.stop()


def _send_requests(url: str) -> None:
    text = "Parrot drafts tokens from the prompt and verifies them in one forward pass. " * 3
    bodies = [
        {"messages": [{"role": "user", "content": "Repeat this text exactly:\n\n" + text}], "max_tokens": 24},
        {"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 12, "stream": True},
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "speculation": {"enabled": False}},
        {"messages": [{"role": "user", "content": "Name a colour as JSON."}], "max_tokens": 16,  # forced tokens
         "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
             "type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}},
    ]
    for body in bodies:
        r = httpx.post(url + "/v1/chat/completions", json={**body, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_dashboard_charts_show_live_data_in_headless_chromium(dashboard_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(dashboard_server.url + "/dashboard?interval=0.5")
            page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=15_000)
            assert page.text_content("#status") == "ok"

            _send_requests(dashboard_server.url)

            # The page polls on its own; wait until every chart has drawn something above zero.
            charts_drawn = " && ".join(f"Number(document.getElementById('chart-{c}').dataset.max) > 0" for c in CHARTS)
            page.wait_for_function(charts_drawn, timeout=30_000)
            page.wait_for_function("document.getElementById('tile-rate').textContent.includes('4 ok')", timeout=30_000)
            for chart in CHARTS:
                canvas = page.locator(f"#chart-{chart}")
                assert int(canvas.get_attribute("data-points")) > 0, chart
                assert page.evaluate(COUNT_LINE_PIXELS, f"chart-{chart}") > 20, f"no line drawn in {chart}"
            assert page.text_content("#tile-rate .value") != "–"
            assert "–" not in page.text_content("#tile-ttft .value")  # p50 and p99 both shown
            assert int(page.text_content("#tile-drafts .value").split("/")[0]) > 0  # drafted tokens
            assert int(page.text_content("#tile-drafts .sub").rsplit("forced", 1)[1]) > 0  # grammar fast-forward
            assert errors == []

            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
