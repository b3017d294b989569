"""The dashboard in a real browser (Playwright driving Debian's chromium) against a real
controller fed by a synthetic engine built from the stubs: the K the page shows for every class
and bucket is GetPolicy's, a new decision appears live, the page recovers by itself after the
controller restarts, and an override is refused without the token and taken with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from benchmarks.demo.screenshot import chromium_path
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.v1 import policy_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN
from tests.integration.engine_client import EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
CLASSES = ("chat", "code", "docs")
WAIT_MS = 10_000


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium_path(),
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            await b.close()


async def _start(**ports: Any) -> RunningServer:
    return await start_server(load_settings(**{**FAST_SETTINGS, "max_classes": 8, **ports}))


async def _engine(server: RunningServer, classes: tuple[str, ...]) -> tuple[Any, EngineClient]:
    ch = grpc.aio.insecure_channel(server.grpc_target)
    engine = EngineClient(ch)
    await engine.connect(hello("engine-1"))
    await engine.send(report(1, *(acceptance(c, (10 * i, 20, 70)) for i, c in
                                  enumerate(classes, start=1))))
    return ch, engine


async def _policy(server: RunningServer) -> policy_pb2.GetPolicyResponse:
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        return await async_policy_stub(ch).GetPolicy(policy_pb2.GetPolicyRequest())


async def _shown_k(page: Page) -> dict[tuple[str, int], int]:
    cells = await page.eval_on_selector_all(
        "#ktable td.kcell", "cs => cs.map(c => [c.dataset.class, +c.dataset.bucket, +c.dataset.k])")
    return {(c, b): k for c, b, k in cells}


async def _until_shown_matches(page: Page, server: RunningServer, timeout: float = 10.0) -> None:
    """The page's K table equals GetPolicy's (it follows within a refresh)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        policy = await _policy(server)
        want = {(c.traffic_class, d.batch_bucket): d.k for c in policy.classes
                for d in c.decisions}
        shown = await _shown_k(page)
        if shown == want and want:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"page shows {shown}, GetPolicy says {want}")
        await asyncio.sleep(0.2)


async def test_the_page_shows_the_policy_follows_it_live_and_survives_a_restart(
        browser: Browser) -> None:
    server = await _start()
    ports = {"grpc_port": server.grpc_port, "http_port": server.http_port}
    ch, engine = await _engine(server, CLASSES[:2])
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        await page.goto(server.http_url + "/")
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
        await _until_shown_matches(page, server)
        policy = await _policy(server)
        n_buckets = len(policy.batch_bucket_upper_bounds) + 1
        assert len(await _shown_k(page)) == len(policy.classes) * n_buckets >= 2 * n_buckets
        await page.evaluate("window.__sameDocument = true")  # gone if the page reloads

        # A new decision arrives live: a class the controller has not seen.
        await engine.send(report(2, acceptance("docs", (5, 5, 90))))
        await expect(page.locator("#log li[data-class=docs]").first).to_be_visible(
            timeout=WAIT_MS)
        await expect(page.locator("#ktable tr[data-class=docs]")).to_have_count(1,
                                                                                timeout=WAIT_MS)
        await _until_shown_matches(page, server)
        assert await page.evaluate("window.__sameDocument === true")

        # The controller goes away: a banner says since when; a new one comes back on the
        # same ports and the page follows it by itself.
        await engine.close()
        await ch.close()
        await server.stop(grace_seconds=0.1)
        banner = page.locator("#banner")
        await expect(banner).to_be_visible(timeout=WAIT_MS)
        await expect(banner).to_contain_text("Disconnected from the controller since")
        server = await _start(**ports)
        ch, engine = await _engine(server, ("after-restart",))
        await expect(banner).to_be_hidden(timeout=WAIT_MS)
        await expect(page.locator("#ktable tr[data-class=after-restart]")).to_have_count(
            1, timeout=WAIT_MS)
        await _until_shown_matches(page, server)
        assert await page.evaluate("window.__sameDocument === true")
        assert errors == []
    finally:
        await engine.close()
        await ch.close()
        await server.stop(grace_seconds=0.1)


async def test_an_override_needs_the_token_and_lands_in_the_audit_log(browser: Browser) -> None:
    server = await _start()
    ch, engine = await _engine(server, CLASSES)
    page = await browser.new_page()
    try:
        await page.goto(server.http_url + "/")
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
        await page.locator("#ktable th.cls", has_text="code").click()
        await expect(page.locator("#detail-title")).to_have_text("Class code")

        # Without the token: refused, with the reason on the page and in the audit log.
        await page.fill("#pin-k", "1")
        await page.click("#do-pin")
        status = page.locator("#write-status")
        await expect(status).to_contain_text("Refused (HTTP 401, unauthenticated)")
        await expect(page.locator("#audit li.refused").first).to_contain_text("unauthenticated")
        assert not server.core.snapshot(0.0).overrides
        # A wrong token: refused too.
        await page.fill("#token", "not-the-token")
        await page.click("#do-pin")
        await expect(status).to_contain_text("Refused (HTTP 403, permission_denied)")
        assert not server.core.snapshot(0.0).overrides

        # With the token: in force, marked on the page, in the audit log.
        await page.fill("#token", TOKEN)
        await page.fill("#note", "canary rollback")
        await page.click("#do-pin")
        await expect(status).to_contain_text("Done: policy version")
        ovr = server.core.snapshot(0.0).overrides
        assert [(o.traffic_class, o.pin_k, o.note) for o in ovr] == [("code", 1, "canary rollback")]
        await expect(page.locator("#overrides li.override").first).to_contain_text(
            'pin K=1 (pod, set by')
        code_cells = page.locator("#ktable td.kcell[data-class=code]")
        await expect(code_cells.first).to_have_attribute("data-k", "1", timeout=WAIT_MS)
        await _until_shown_matches(page, server)
        await expect(page.locator("#audit li").first).to_contain_text("pin_k=1 on code (pod)")
        await expect(page.locator("#audit li").first).to_contain_text(": ok")

        # Clearing hands the class back to the controller.
        await page.click("#do-clear")
        await expect(status).to_contain_text("Done: policy version")
        assert not server.core.snapshot(0.0).overrides
    finally:
        await engine.close()
        await ch.close()
        await server.stop(grace_seconds=0.1)


async def _unmeasured(page: Page, traffic_class: str) -> list[int]:
    return sorted(await page.eval_on_selector_all(
        f"#ktable td.kcell.unmeasured[data-class={traffic_class}]",
        "cs => cs.map(c => +c.dataset.bucket)"))


async def test_batch_ranges_without_a_timed_step_are_marked_as_priors_only(
        browser: Browser) -> None:
    """Before any step is timed every batch range's choice comes from the priors, and the page
    says so on every cell; once an engine times steps at batch 3 and 20, exactly those two
    ranges lose the mark (GetPolicy lists them), the rest keep it."""
    from specpilot.contract.buckets import bucket_of
    from specpilot.v1 import engine_pb2

    server = await _start()
    ch, engine = await _engine(server, CLASSES[:1])
    page = await browser.new_page()
    try:
        await page.goto(server.http_url + "/")
        await _until_shown_matches(page, server)
        policy = await _policy(server)
        bounds = tuple(policy.batch_bucket_upper_bounds)
        every = list(range(len(bounds) + 1))
        assert list(policy.measured_batch_buckets) == []
        assert await _unmeasured(page, "chat") == every  # the control: all marked
        timed = sorted({bucket_of(bounds, 3), bucket_of(bounds, 20)})
        steps = [engine_pb2.StepTiming(batch_bucket=b, draft="", k=0, steps=10,
                                       sum_batch_size=10 * size, sum_verified_tokens=10 * size,
                                       sum_step_seconds=0.2)
                 for b, size in zip(timed, (3, 20), strict=True)]
        msg = report(2, acceptance("chat"))
        msg.step_timings.extend(steps)
        await engine.send(msg)
        deadline = asyncio.get_running_loop().time() + 10
        while await _unmeasured(page, "chat") != [b for b in every if b not in timed]:
            assert asyncio.get_running_loop().time() < deadline, await _unmeasured(page, "chat")
            await asyncio.sleep(0.2)
        assert list((await _policy(server)).measured_batch_buckets) == timed
        title = await page.get_attribute(
            f"#ktable td.kcell[data-class=chat][data-bucket='{every[-1]}']", "title")
        assert title is not None and "from the priors" in title
    finally:
        await page.close()
        await engine.close()
        await ch.close()
        await server.stop(grace_seconds=0.1)


async def test_with_a_read_token_the_page_opened_with_it_reads_and_follows_live(
        browser: Browser) -> None:
    """The controller asks for dashboard_read_token: the page opened as /#read_token=... reads
    the state and keeps its event stream with it (an EventSource sends it as ?token=), under
    the page's content security policy with no violation; opened without it, it stays
    disconnected. Control: the page sent no token (every read 401)."""
    server = await _start(dashboard_read_token="read-0123456789")
    ch, engine = await _engine(server, CLASSES)
    page = await browser.new_page()
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text)
            if "Content Security Policy" in m.text else None)
    try:
        await page.goto(server.http_url + "/")
        await expect(page.locator("#status")).to_have_text("disconnected", timeout=WAIT_MS)
        await page.goto(server.http_url + "/#read_token=read-0123456789")
        await page.reload()  # a new fragment alone does not reload the page
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
        assert "read_token" not in page.url  # kept for the tab, off the address bar
        await _until_shown_matches(page, server)
        await engine.send(report(2, acceptance("chat", (90, 5, 5))))  # a new decision, live
        await _until_shown_matches(page, server)
        assert not violations, violations
    finally:
        await page.close()
        await ch.close()
        await server.stop(grace_seconds=0.1)


# Markup an engine may put in every name it chooses: each would run script or load an image if
# the page wrote names as HTML instead of text.
_MARKUP = '<img src=x onerror="window.__pwned=1">'


async def test_names_an_engine_chooses_are_shown_as_text_never_run(browser: Browser) -> None:
    """An engine whose id, model, hardware and draft name carry markup: the page shows each as
    the literal text (the engine row and the K cell name them), no handler runs, no image
    element appears. Control: the page shows the names at all (the row and the cell are found
    by the names), so a page that dropped them would fail, not pass."""
    server = await _start()
    ch = grpc.aio.insecure_channel(server.grpc_target)
    engine = EngineClient(ch)
    first = hello("e" + _MARKUP)
    first.model = "m" + _MARKUP
    first.hardware = "h" + _MARKUP
    first.drafts[0].name = "d" + _MARKUP
    await engine.connect(first)
    await engine.send(report(1, acceptance("chat", (0, 0, 0, 0, 100), draft="d" + _MARKUP)))
    page = await browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    try:
        await page.goto(server.http_url + "/")
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
        row = page.locator("tr[data-engine]")
        await expect(row).to_have_count(1, timeout=WAIT_MS)
        assert await row.get_attribute("data-engine") == "e" + _MARKUP
        text = await row.inner_text()
        for name in ("e", "m", "h"):
            assert name + _MARKUP in text, text
        await _until_shown_matches(page, server)
        cells = await page.eval_on_selector_all("#ktable td.kcell",
                                                "cs => cs.map(c => c.innerText)")
        assert any(("d" + _MARKUP) in c for c in cells), cells
        assert await page.evaluate("() => window.__pwned") is None
        assert await page.locator("img[src=x]").count() == 0
        assert not dialogs, dialogs
    finally:
        await page.close()
        await ch.close(None)
        await server.stop(grace_seconds=0.1)
