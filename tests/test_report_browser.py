"""The tiny run's report as a reader sees it, in headless Chromium (Debian's, driven by selenium):
every result category opens, lists its figures, and one figure of each displays. A screenshot of
the last figure shown is kept in tests/out/. Skipped, saying why, where Chromium, its driver or
selenium is missing (.ci/run installs the first two from Debian)."""

import shutil
import time
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
CATEGORIES = ["Accuracy", "Attention", "Head pruning", "MLP activations", "Mediation"]  # the tiny run's
GENERAL = ("Workflow", "Statistics", "About")  # the menu's entries above the result categories


def _browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    # no network: this machine refuses Chromium's background connections, many at a time
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def _wait(condition, seconds: float = 10.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    return condition()


def _click(find, seconds: float = 5.0) -> None:
    """Click the element ``find()`` returns, again while another element takes the click: the
    report's navigation animates (transition-all), and a machine under load can click before its
    links have settled (seen once in a full suite run)."""
    from selenium.common.exceptions import ElementClickInterceptedException

    deadline = time.time() + seconds
    while True:
        try:
            return find().click()
        except ElementClickInterceptedException:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def _figures_listed(driver):
    from selenium.webdriver.common.by import By
    return _wait(lambda: [row for row in driver.find_elements(By.XPATH, "//table//tr[td]")
                          if row.text.strip().endswith((".png", ".svg", ".pdf"))], 3)


def _open_first_figure(driver, page: str, category: str) -> tuple[list[str], int]:
    """(the figure files the category lists, the width of the first one as displayed), from the
    report's front page. A category with subcategories (a model, a dataset, a table's own) shows
    their names first; the first subcategory that lists figures is opened."""
    from selenium.webdriver.common.by import By

    def link(text):
        return driver.find_element(By.XPATH, f"//nav//a[.//span[normalize-space()={text!r}] or normalize-space()={text!r}]")

    def open_category():
        driver.get(page)
        _wait(lambda: driver.find_elements(By.XPATH, f"//nav//a[.//span[normalize-space()={category!r}]]"))
        _click(lambda: link(category))
    open_category()
    figures = _figures_listed(driver)
    if not figures:
        subcategories = _wait(lambda: [a.text for a in driver.find_elements(By.XPATH, "//nav//div[@class='p-3']//a")
                                       if a.text.strip()], 3)
        assert subcategories, f"{category}: neither figures nor subcategories listed"
        for subcategory in subcategories:
            open_category()
            _click(lambda: link(subcategory))
            figures = _figures_listed(driver)
            if figures:
                break
        assert figures, f"{category}: none of the subcategories {subcategories} lists a figure"
    names = [row.text.strip() for row in figures]
    _click(lambda: figures[0].find_element(By.XPATH, ".//a[@iconname='eye']"))
    width = _wait(lambda: max([driver.execute_script("return arguments[0].naturalWidth", image)
                               for image in driver.find_elements(By.XPATH, "//img[contains(@src, 'data/raw')]")
                               if image.is_displayed()] or [0]))
    return names, width


def test_every_category_opens_and_shows_a_figure(tiny_report, tmp_path):
    if not (CHROMIUM and DRIVER):
        pytest.skip("no Chromium here (Debian packages chromium and chromium-driver; .ci/run installs them as root)")
    pytest.importorskip("selenium", reason="selenium is a test requirement (requirements-test.txt)")
    from selenium.webdriver.common.by import By
    with zipfile.ZipFile(tiny_report) as archive:
        archive.extractall(tmp_path / "unzipped")
    driver = _browser(tmp_path / "profile")
    try:
        page = (tmp_path / "unzipped" / "report" / "report.html").as_uri()
        driver.get(page)
        listed = _wait(lambda: [a.text.strip() for a in driver.find_elements(By.XPATH, "//nav//a")
                                if a.text.strip() and a.text.strip() not in GENERAL])
        assert set(listed) >= set(CATEGORIES), listed
        for category in listed:  # every category the report lists, not only those expected
            names, width = _open_first_figure(driver, page, category)
            assert names, f"{category}: no figure listed"
            assert width > 100, f"{category}: {names[0]} did not display"
        (REPO / "tests" / "out").mkdir(exist_ok=True)
        driver.save_screenshot(str(REPO / "tests" / "out" / "report_browser.png"))
    finally:
        driver.quit()
