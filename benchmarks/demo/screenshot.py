"""A screenshot of the dashboard, for the README: Playwright driving Debian's chromium (no
browser download), full page, with one class opened to show its estimates and controls.

    specpilot demo --screenshot docs/img/dashboard.png
"""

from __future__ import annotations

import shutil
from pathlib import Path

WIDTH, HEIGHT = 1280, 900
WAIT_MS = 15_000


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("chromium not found: apt-get install chromium (Debian package)")
    return path


def capture_dashboard(url: str, path: Path, open_class: str | None = None) -> Path:
    """Load the dashboard at ``url`` (the controller's HTTP address), wait until its K table,
    decision log and (for ``open_class``) the class's chart are drawn, and save a PNG."""
    from playwright.sync_api import sync_playwright  # a dev dependency: only when asked for

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(),
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.goto(url.rstrip("/") + "/")
            page.wait_for_selector("#ktable td.kcell", timeout=WAIT_MS)
            page.wait_for_selector("#log li", timeout=WAIT_MS)
            if open_class is not None:
                page.locator("#ktable th.cls", has_text=open_class).first.click()
                page.wait_for_selector("#acceptance-chart polyline", timeout=WAIT_MS)
            page.wait_for_timeout(500)  # the live stream's first refresh
            path.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(path), full_page=True)
        finally:
            browser.close()
    return path
