"""scripts/explain.py's page in a real browser (headless Chromium through Selenium): open the
file, click "next block" four times, read the displayed output and check it against the exact
softmax·V to 1e-6; a screenshot is saved beside the page. CI installs Chromium and its driver
(.ci/run, which makes their absence a failure); elsewhere the test says what it lacks."""
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import explain  # noqa: E402

webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        message = "needs Chromium and chromedriver (apt install chromium chromium-driver)"
        if os.environ.get("NUMBA_FLASH_REQUIRE_BROWSER") == "1":  # (.ci/run sets it)
            pytest.fail(message)
        pytest.skip(message)
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,1400"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def _numbers(text):
    return np.array([float(x) for x in text.split(",")])


@pytest.mark.parametrize("seed, block", [(0, "4"), (7, "8")])
def test_four_blocks_give_the_exact_softmax_times_v(tmp_path, browser, seed, block):
    path, data = explain.write_page(tmp_path, seed, explain.MEMORY_JSON)
    browser.get(path.as_uri())
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element(By.ID, "block-size")).select_by_visible_text(block)
    case = data["softmax"][block]
    scores = np.array([s for step in case["steps"] for s in step["scores"]])
    weights = np.exp(scores - scores.max())
    exact = (weights / weights.sum()) @ np.array(case["values"])  # computed again here
    shown = []
    for _ in range(4):
        browser.find_element(By.ID, "next").click()
        shown.append(_numbers(browser.find_element(By.ID, "out").text))
    assert np.abs(shown[-1] - exact).max() < 1e-6
    assert np.abs(shown[0] - exact).max() > 1e-6  # one block is not the whole row
    assert np.abs(_numbers(browser.find_element(By.ID, "exact").text) - exact).max() < 1e-6
    assert browser.find_element(By.ID, "next").get_attribute("disabled") is not None
    agreement = browser.find_element(By.ID, "agreement").text
    assert f"to {case['digits']} digits" in agreement and case["digits"] >= 12
    browser.find_element(By.ID, "prev").click()
    assert np.abs(_numbers(browser.find_element(By.ID, "out").text) - shown[2]).max() == 0
    assert browser.find_elements(By.CSS_SELECTOR, "#traffic path")  # panel 2 drew its lines
    assert browser.save_screenshot(str(tmp_path / "explainer.png"))
    assert (tmp_path / "explainer.png").stat().st_size > 10_000
