"""The search page of trainer/search/serve.py in headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium): a typed caption puts its image first in the grid, an
uploaded photo lists sentences, a click on a photo opens Figure 4, an API error is a message in
the page; the browser console stays free of errors.

Without Chromium the tests are skipped, unless DEFRAG_REQUIRE_CHROMIUM=1 (set by .ci/run) turns
the skip into a failure. DEFRAG_SCREENSHOT=PATH saves the page after a search of the generated
photos (docs/search-app.png shows the same page over the Flickr8k dev index)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

import trainer.search.serve as serve
from tests.search_world import SearchWorld, search_world, serving
from trainer.search.index import SearchIndex

pytestmark = pytest.mark.slow
INSTALL = "(Debian: apt-get install chromium chromium-driver)"


def require_chromium() -> tuple[str, str]:
    """The browser and driver programs; skip (fail under DEFRAG_REQUIRE_CHROMIUM=1) without."""
    found = {name: shutil.which(name) for name in ("chromium", "chromedriver")}
    missing = [name for name, path in found.items() if path is None]
    if missing and os.environ.get("DEFRAG_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"browser test: {', '.join(missing)} not found {INSTALL} "
                    "(DEFRAG_REQUIRE_CHROMIUM=1)")
    if missing:
        pytest.skip(f"browser test: {', '.join(missing)} not found {INSTALL}")
    return found["chromium"], found["chromedriver"]


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, chromedriver = require_chromium()
    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,860", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> SearchWorld:
    return search_world(tmp_path_factory.getbasetemp() / "search-world")


@pytest.fixture(scope="module")
def url(world: SearchWorld) -> Iterator[str]:
    with serving(serve.create_app(SearchIndex.open(world.index), 2**20)) as base:
        yield base


@pytest.fixture
def page(browser: WebDriver, url: str) -> Iterator[WebDriver]:
    """The page, freshly loaded with its index's counts shown; no console error afterwards
    (a test expecting some reads them first: reading the log empties it)."""
    browser.get(url)
    wait(browser, lambda d: " photos · " in d.find_element(By.ID, "info").text)
    yield browser
    assert console_errors(browser) == []


def console_errors(driver: WebDriver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait(driver: WebDriver, condition, timeout: float = 20):
    return WebDriverWait(driver, timeout).until(condition)


def search(driver: WebDriver, text: str) -> None:
    box = driver.find_element(By.ID, "query")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.CSS_SELECTOR, "#search-form button[type=submit]").click()


def loaded(driver: WebDriver, image) -> bool:
    return driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0",
                                 image)


def test_a_caption_puts_its_image_first(page: WebDriver, world: SearchWorld) -> None:
    search(page, world.query)
    cards = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#grid .card"))
    assert len(cards) == len(world.captions)  # k = 12 of 8 photos: all of them
    assert cards[0].find_element(By.CLASS_NAME, "name").text == world.expected
    assert cards[0].find_element(By.CLASS_NAME, "rank").text == "#1"
    wait(page, lambda d: all(loaded(d, img) for img in d.find_elements(By.CSS_SELECTOR,
                                                                      "#grid img")))
    assert world.query in page.find_element(By.ID, "images-title").text
    assert page.find_element(By.ID, "images-proof").text.startswith(
        f"Exact top {len(world.captions)}: proven")
    if os.environ.get("DEFRAG_SCREENSHOT"):
        page.save_screenshot(os.environ["DEFRAG_SCREENSHOT"])


def test_an_uploaded_photo_lists_sentences(page: WebDriver, world: SearchWorld) -> None:
    page.find_element(By.ID, "upload").send_keys(str(world.photos / world.expected))
    items = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#sentence-list li"))
    assert len(items) == 12
    sentences = {text for texts in world.captions.values() for text in texts}
    assert all(item.find_element(By.CLASS_NAME, "text").text in sentences for item in items)
    assert world.expected in page.find_element(By.ID, "sentences-title").text
    assert page.find_element(By.ID, "sentences-proof").text.startswith("Exact top 12: proven")
    assert loaded(page, page.find_element(By.ID, "sentences-image"))


def test_a_click_on_a_photo_explains_it(page: WebDriver, world: SearchWorld) -> None:
    search(page, world.query)
    first = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#grid .card .thumb"))[0]
    first.click()
    dialog = wait(page, lambda d: d.find_element(By.ID, "explain"))
    wait(page, lambda d: dialog.get_attribute("open") is not None)
    wait(page, lambda d: loaded(d, d.find_element(By.ID, "explain-image")))
    rows = page.find_elements(By.CSS_SELECTOR, "#explain-details tbody tr")
    assert rows and all(row.find_elements(By.TAG_NAME, "td")[1].text == "0" for row in rows)
    assert world.query in page.find_element(By.ID, "explain-sentence").text
    dialog.find_element(By.CLASS_NAME, "close").click()
    wait(page, lambda d: dialog.get_attribute("open") is None)
    # Sentences of an indexed photo, each explained against it.
    page.find_element(By.CSS_SELECTOR, "#grid .card .link").click()
    why = wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#sentence-list .link"))
    why[0].click()
    wait(page, lambda d: dialog.get_attribute("open") is not None)
    wait(page, lambda d: loaded(d, d.find_element(By.ID, "explain-image")))


def test_an_api_error_is_a_message_in_the_page(page: WebDriver) -> None:
    """The API's line in #error; the console has only the browser's note of the 400 answer."""
    search(page, "xyzzy plugh")
    error = page.find_element(By.ID, "error")
    wait(page, lambda d: error.is_displayed())
    assert error.text.startswith("the query has no fragment the model knows")
    [logged] = console_errors(page)
    assert "/api/search?q=xyzzy+plugh" in logged and "status of 400 (Bad Request)" in logged
    search(page, "a red star")
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#grid .card"))
    assert not error.is_displayed()
    assert page.find_element(By.ID, "query").get_attribute("maxlength") == "1000"
