"""The Gradio Space (space_app/app.py): started on localhost, driven with gradio_client, and shown in headless
Chromium. The screenshot goes to a temporary folder; with DSPARK_UPDATE_SCREENSHOT=1 it replaces
docs/assets/space.png, which the docs show (a test run never edits the checkout otherwise)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "space_app" / "app.py"
DOCS_SCREENSHOT = ROOT / "docs" / "assets" / "space.png"

pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def space_url(tmp_path_factory):
    port = _free_port()
    # The page opens on the embedded pair when demo_models/ exists, else on the tiny random pair.
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "DSPARK_SPACE_MAX_NEW_TOKENS": "24"}
    log = tmp_path_factory.mktemp("space") / "space.log"
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, str(APP)], cwd=tmp_path_factory.mktemp("cwd"), env=env,
                                   stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the Space did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def test_space_generates_coloured_tokens_and_chart(space_url):
    client = gradio_client.Client(space_url, verbose=False)
    result = client.predict(
        "tiny random pair (offline, untrained)", "", "", "def add(a, b):", False, 0.0, 4, "fixed", 0.5, 8, 0,
        api_name="/generate",
    )
    plain_html, plain_speed, dspark_html, dspark_speed, chart, calibration, summary = result
    assert "tok-plain" in plain_html and "tokens/s" in plain_speed
    # every DSpark token carries the colour of how it was produced (random drafts: corrections, never accepted)
    assert "tok-corrected" in dspark_html or "tok-accepted" in dspark_html
    assert dspark_html.count('class="tok ') == plain_html.count('class="tok ') == 8
    assert "tokens/s" in dspark_speed
    assert chart is not None  # the acceptance-per-position plot
    assert calibration and Path(calibration).is_file()
    assert "τ" in summary and "speedup" in summary


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver")
def test_space_in_headless_chromium(space_url, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1700", "--hide-scrollbars"):
        options.add_argument(flag)
    os.environ.setdefault("SE_AVOID_STATS", "true")
    screenshot = tmp_path / "space.png"
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.get(space_url)
        wait = WebDriverWait(driver, 120, poll_frequency=0.5)
        button = wait.until(lambda d: next((b for b in d.find_elements(By.TAG_NAME, "button")
                                            if b.text.strip() == "Generate"), None))
        prompt = driver.find_element(By.CSS_SELECTOR, "textarea")
        prompt.clear()
        prompt.send_keys("def add(a, b):")
        button.click()
        wait.until(lambda d: "speedup" in d.find_element(By.ID, "summary").text)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#dspark-output .tok"))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "img"))  # the calibration diagram
        time.sleep(1.0)
        assert driver.find_elements(By.CSS_SELECTOR, "#plain-output .tok-plain")
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(height, 1200), 2600))
        time.sleep(0.5)
        assert driver.save_screenshot(str(screenshot))
    finally:
        driver.quit()
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("DSPARK_UPDATE_SCREENSHOT") == "1":
        shutil.copy(screenshot, DOCS_SCREENSHOT)
