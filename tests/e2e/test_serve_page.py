"""The page ``dgr serve`` serves at ``/``, in headless Chromium (Debian's ``chromium``, driven
by Playwright with ``executable_path``: nothing is downloaded): it shows the route's stages as
the workers describe themselves, and a question typed in gets the model's answer, streamed.
The screenshot is saved in the test's output directory (its path printed) and, when
``$DGR_SCREENSHOT`` is set, copied there too."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from benchmarks.serve_latency import ServerProcess
from dgr_engine.options import EngineOptions
from tests.harness import SMOLLM2, RealLane

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's chromium (``./dgr.sh test`` installs it where it is missing)."""
ANSWER_LIMIT_MS = 120_000
"""Bound on waiting for the page's answer (three workers on two shared cores)."""


@pytest.fixture(scope="module")
def server(smollm2_lane: RealLane) -> Iterator[ServerProcess]:
    started = ServerProcess.dgr(
        SMOLLM2, 3, options=EngineOptions(), extra=smollm2_lane.serve_args()
    )
    try:
        yield started
    finally:
        started.stop()


def test_the_page_shows_the_route_and_answers_a_question(
    server: ServerProcess, tmp_path: Path
) -> None:
    assert CHROMIUM.is_file(), "Debian's chromium is missing: ./dgr.sh test installs it"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(server.url + "/")
            stages = page.locator("tr.stage")
            expect(stages).to_have_count(3, timeout=30_000)
            expect(stages.nth(0)).to_contain_text("[0, 10)")
            expect(stages.nth(2)).to_contain_text("[20, 30)")
            expect(stages.nth(1)).to_contain_text("certified (real-hardware)")
            expect(stages.nth(1)).to_contain_text("serving")
            expect(page.locator("#facts")).to_contain_text(SMOLLM2)

            page.locator("#prompt").fill("What is the capital of France?")
            page.locator("#prompt").press("Enter")
            answer = page.locator('.msg.assistant[data-state="done"]')
            expect(answer).to_have_count(1, timeout=ANSWER_LIMIT_MS)
            expect(answer).to_contain_text("The capital of France is Paris.")
            expect(answer.locator(".meta")).to_contain_text("first token")
            expect(page.locator(".msg.user")).to_have_text("What is the capital of France?")

            shot = tmp_path / "dgr-serve-page.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    wanted = os.environ.get("DGR_SCREENSHOT")
    if wanted:
        shutil.copyfile(shot, wanted)
        print(f"screenshot: {wanted}")
