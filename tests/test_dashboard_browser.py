"""The live dashboard in a real headless browser (Debian's chromium, driven by playwright)
while a real coordinator runs: the page must show the version rising and the final metric."""

import json
import shutil
import threading
import time

import pytest
from fake_grid import FakeGrid, small_config

from fedrl.clients.client_app import app as client_app
from fedrl.ports import free_port
from fedrl.strategies.coordinator import run_coordinator

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# no first-run, sync or update traffic: this machine's network is closed
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_dashboard_shows_a_rising_version_and_the_final_metric(tmp_path):
    cfg = small_config(tmp_path, versions=5, eval_every=1, monitor_port=free_port())
    page_ready = threading.Event()

    def pace(coord):  # the run waits at v1 for the page, then goes on slowly enough to be watched
        if coord.version == 1:
            page_ready.wait(120)
        time.sleep(0.3)

    result: dict = {}
    run = threading.Thread(
        target=lambda: result.update(summary=run_coordinator(FakeGrid(3, client_app), cfg, progress=pace))
    )
    run.start()
    try:
        monitor = tmp_path / "run" / "monitor.json"
        for _ in range(600):
            if monitor.exists() or not run.is_alive():
                break
            time.sleep(0.1)
        url = json.loads(monitor.read_text())["dashboard"]
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_function("document.getElementById('version').textContent === '1'", timeout=120_000)
            page.evaluate(
                """() => { const el = document.getElementById('version'); window.seen = [+el.textContent];
                new MutationObserver(() => window.seen.push(+el.textContent))
                    .observe(el, {childList: true, characterData: true, subtree: true}); }"""
            )
            page_ready.set()
            page.wait_for_function("document.getElementById('final').textContent !== '-'", timeout=300_000)
            seen = page.evaluate("window.seen")
            final = page.text_content("#final")
            status = page.text_content("#status")
            rows = page.locator("#clients tbody tr").count()
            rounds = sum(
                int(td) for td in page.locator("#clients tbody tr td:nth-child(4)").all_text_contents()
            )
            bars = page.evaluate("[...S.clients.values()].reduce((n, c) => n + c.rounds.length, 0)")
            cells = page.locator("#clients tbody tr td:nth-child(13)").all_text_contents()
            accepted = [int(td) for td in cells]
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        page_ready.set()
        run.join(300)
    summary = result["summary"]
    assert seen == sorted(seen) and seen[0] == 1 and max(seen) == summary["versions"] >= 3, seen
    assert len(set(seen)) >= 3  # the page followed the run version by version, without a reload
    assert float(final) == pytest.approx(summary["final_eval"], abs=5e-4)
    assert status.startswith("finished") and rows == len(summary["clients"]) == 3
    assert rounds == bars == summary["rounds"]  # every reply in the table and on the timeline
    # each client's uploads accepted, as the run's ledger counts them
    assert sorted(accepted) == sorted(row["accepted"] for row in summary["ledger"].values()), accepted
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
