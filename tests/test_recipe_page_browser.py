"""The recipe page in real headless Chromium (Debian `chromium` + `chromium-driver`): click the
controls, and every displayed command equals what `sous recipe plan --format shell` prints for
the same selection; excluded selections cannot be chosen; the language switch changes the copy;
the static output (file://) shows the same; the recipe picker switches between the shipped
recipes. One browser serves every test of the module."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from sous.recipes.catalog import list_recipes, load_recipe, load_recipe_file, shipped_names
from sous.recipes.page import plain
from sous.recipes.web.server import make_server, write_static
from test_recipe_page import EXCLUDED, excluded_recipe

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SHIPPED, EXCL = "minimax-m2.7", "minimax-m2.7-excl"
AT_SHIPPED = f"#recipe={SHIPPED}"  # the page opens on the first shipped recipe otherwise
SOUS = str(Path(sys.executable).with_name("sous"))
ROUTER_HEAD = "# router (after the servers are up)\n"
ARTIFACTS = Path(os.environ.get("SOUS_TEST_ARTIFACTS",
                                Path(tempfile.gettempdir()) / "sous-test-artifacts"))
# (strategy, target, selection): every strategy and target of the shipped recipe, and every
# value of every axis at least once.
SELECTIONS = [
    ("aggregated-data-expert-parallel", "Latency",
     dict(lmcache="cpu", prefix_caching="on", spec_decode="suffix", reasoning_parser="off",
          tool_calling="on")),
    ("aggregated-data-expert-parallel", "Throughput",
     dict(lmcache="rds", prefix_caching="off", spec_decode="eagle3", reasoning_parser="on",
          tool_calling="off")),
    ("aggregated-pipeline-parallel", "Throughput",
     dict(lmcache="off", prefix_caching="on_sub_block", spec_decode="off",
          reasoning_parser="off", tool_calling="off")),
    ("prefill-decode-disaggregated", "Latency",
     dict(lmcache="rds", prefix_caching="on_sub_block", spec_decode="eagle3",
          reasoning_parser="on", tool_calling="on")),
    ("prefill-decode-disaggregated", "Throughput",
     dict(lmcache="cpu", prefix_caching="on", spec_decode="suffix", reasoning_parser="off",
          tool_calling="off")),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """(server base URL, static index URL, path of the recipe with `excluded` entries): the
    page of the shipped recipes and that one; the server runs in a thread for the module."""
    tmp = tmp_path_factory.mktemp("recipe-page")
    excl = excluded_recipe(tmp)
    recipes = [*list_recipes(), load_recipe_file(excl)]
    write_static(tmp / "site", recipes)
    server = make_server(recipes, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield (f"http://127.0.0.1:{server.server_address[1]}/",
           (tmp / "site" / "index.html").as_uri(), str(excl))
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), \
        "the browser tests need Debian's chromium and chromium-driver (make test installs them)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                "--window-size=1280,1600"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield d
    d.quit()


# ----------------------------------------------------------------------------- helpers


def load(d, url: str) -> None:
    d.get("about:blank")
    d.get(url)
    assert d.find_element(By.ID, "model-name").text


def hash_params(d) -> dict[str, str]:
    return dict(parse_qsl(d.execute_script("return location.hash").lstrip("#")))


def click_label(d, input_id: str) -> None:
    d.find_element(By.CSS_SELECTOR, f"label[for='{input_id}']").click()


def choose(d, slug: str, target: str, sel: dict[str, str]) -> None:
    """Click the strategy tab, the target and every axis control to reach `sel`."""
    d.find_element(By.ID, f"tab-{slug}").click()
    if d.find_elements(By.ID, "target-group"):
        click_label(d, f"opt-target-{target}")
    else:
        assert d.find_element(By.ID, "target-only").get_attribute("data-target") == target
    for axis, value in sel.items():
        switch = d.find_elements(By.ID, f"opt-{axis}")
        if switch:
            if switch[0].is_selected() != (value == "on"):
                click_label(d, f"opt-{axis}")
        else:
            click_label(d, f"opt-{axis}-{value}")
    params = hash_params(d)
    assert params == {"recipe": params["recipe"], "strategy": slug, "target": target,
                      "lang": params["lang"], **sel}


def shown(d) -> dict[str, list]:
    """What the page shows: process blocks and router blocks as (label, text), the script."""
    def blocks(kind):
        return [(e.get_attribute("data-label"), e.get_property("textContent"))
                for e in d.find_elements(By.CSS_SELECTOR, f"code[data-block='{kind}']")]
    (script,) = blocks("script")
    return {"process": blocks("process"), "router": blocks("router"), "script": script[1]}


def plan_output(recipe: str, slug: str, target: str, sel: dict[str, str]) -> str:
    argv = [SOUS, "recipe", "plan", recipe, "--strategy", slug, "--target", target,
            "--format", "shell", "--set", *(f"{a}={v}" for a, v in sel.items())]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def assert_shows_plan(page: dict[str, list], expected: str) -> None:
    """The displayed blocks, in order, are exactly the plan output after its header."""
    header = expected.split("\n\n", 1)[0]
    body = [f"# {label}\n{text}" for label, text in page["process"]]
    if page["router"]:
        body.append(ROUTER_HEAD + "\n\n".join(text for _, text in page["router"]))
    assert "\n\n".join([header, *body]) + "\n" == expected
    assert page["script"] == expected


# ----------------------------------------------------------------------------- tests


def test_clicked_selections_show_plan_output(driver, site):
    server = site[0]
    load(driver, server)
    assert hash_params(driver)["recipe"] == shipped_names()[0]
    load(driver, server + AT_SHIPPED)
    assert hash_params(driver)["recipe"] == SHIPPED
    for slug, target, sel in SELECTIONS:
        choose(driver, slug, target, sel)
        page = shown(driver)
        assert_shows_plan(page, plan_output(SHIPPED, slug, target, sel))
        roles = {label.split()[0] for label, _ in page["process"]}
        assert roles == ({"prefill", "decode"} if slug.startswith("prefill") else {"main"})
        assert bool(page["router"]) == slug.startswith("prefill")


def test_link_keeps_selection_and_static_output_matches(driver, site):
    server, static, _ = site
    slug, target, sel = SELECTIONS[4]
    load(driver, server + AT_SHIPPED)
    choose(driver, slug, target, sel)
    fragment = driver.execute_script("return location.hash")
    served = shown(driver)
    for base in (server, static):
        load(driver, base + fragment)
        assert hash_params(driver) == dict(parse_qsl(fragment.lstrip("#")))
        assert shown(driver) == served
        for axis in ("lmcache", "prefix_caching", "spec_decode"):
            assert driver.find_element(By.ID, f"opt-{axis}-{sel[axis]}").is_selected()
        assert not driver.find_element(By.ID, "opt-tool_calling").is_selected()
    assert_shows_plan(served, plan_output(SHIPPED, slug, target, sel))
    load(driver, static + AT_SHIPPED)  # the static page: the default selection, recommended
    assert driver.find_element(By.ID, "recommended-btn").get_attribute("aria-pressed") == "true"
    slug, target, sel = SELECTIONS[0]
    choose(driver, slug, target, sel)
    assert_shows_plan(shown(driver), plan_output(SHIPPED, slug, target, sel))


def test_recommended_button_and_fit(driver, site):
    server = site[0]
    load(driver, server + AT_SHIPPED + "&strategy=prefill-decode-disaggregated&target=Latency"
         "&lmcache=off")
    button = driver.find_element(By.ID, "recommended-btn")
    assert button.get_attribute("aria-pressed") == "false"
    button.click()
    rec = SELECTIONS[3][2]
    assert {k: v for k, v in hash_params(driver).items() if k in rec} == rec
    assert_shows_plan(shown(driver), plan_output(SHIPPED, *SELECTIONS[3][:2], rec))
    cards = driver.find_elements(By.CSS_SELECTOR, ".fit-card")
    assert [c.find_element(By.TAG_NAME, "h4").text for c in cards] == \
        ["prefill rank 0", "decode ranks 0-3"]
    decode = cards[1]
    figure = {e.get_attribute("data-fit"): e.find_element(By.TAG_NAME, "dd").text
              for e in decode.find_elements(By.CSS_SELECTOR, "[data-fit]")}
    assert figure == {"kv-token": "126,976 B", "kv-rank": "25.2 GiB", "weights": "57.3 GiB",
                      "room": "66.7 GiB", "verdict": "Fits",
                      "largest": "557,053 tokens for 1 sequence(s) "
                                 "(the model's maximum is 204,800)"}
    driver.find_element(By.ID, "tab-aggregated-pipeline-parallel").click()
    assert driver.find_element(By.ID, "recommended-btn").get_attribute("disabled") is not None


def test_excluded_selection_cannot_be_chosen(driver, site):
    server, _, excl = site
    slug = "aggregated-pipeline-parallel"
    load(driver, server + f"#recipe={EXCL}&strategy={slug}")
    click_label(driver, "opt-lmcache-rds")
    suffix = driver.find_element(By.ID, "opt-spec_decode-suffix")
    assert not suffix.is_enabled()
    why = driver.find_element(By.ID, "opt-spec_decode-suffix-why").text
    assert why == "Not available with KV Offload: LMCache (RDS)"
    assert suffix.get_attribute("aria-describedby") == "opt-spec_decode-suffix-why"
    before = shown(driver)
    click_label(driver, "opt-spec_decode-suffix")
    assert hash_params(driver)["spec_decode"] == "off" and shown(driver) == before
    assert not suffix.is_selected()
    click_label(driver, "opt-prefix_caching-on_sub_block")  # excluded with tool_calling=off
    switch = driver.find_element(By.ID, "opt-tool_calling")
    assert switch.is_selected() and not switch.is_enabled()
    driver.find_element(By.CSS_SELECTOR, "label[for='opt-tool_calling']").click()
    assert hash_params(driver)["tool_calling"] == "on"
    sel = dict(lmcache="rds", prefix_caching="on_sub_block", spec_decode="off",
               reasoning_parser="on", tool_calling="on")
    assert_shows_plan(shown(driver), plan_output(excl, slug, "Throughput", sel))
    refused = subprocess.run([SOUS, "recipe", "plan", excl, "--strategy", slug, "--set",
                              "lmcache=rds", "spec_decode=suffix"], capture_output=True, text=True)
    assert refused.returncode == 2 and "excluded[0]" in refused.stderr
    # A link to an excluded selection falls back to the default and says so.
    load(driver, server + f"#recipe={EXCL}&strategy={slug}&lmcache=rds&spec_decode=suffix")
    assert driver.find_element(By.CSS_SELECTOR, "#axes .notice").text.startswith(
        "The link named a selection that is not available")
    assert hash_params(driver)["lmcache"] == "off"
    assert EXCLUDED[0] == {"lmcache": "rds", "spec_decode": "suffix"}


def test_language_switch(driver, site):
    server = site[0]
    load(driver, server + AT_SHIPPED)
    recipe = load_recipe(SHIPPED).recipe
    assert driver.find_element(By.CSS_SELECTOR, "#model .sub").text == plain(recipe.text["en"].sub)
    assert driver.find_element(By.ID, "options-title").text == "Options"
    driver.find_element(By.ID, "lang-ko").click()
    assert driver.find_element(By.TAG_NAME, "html").get_attribute("lang") == "ko"
    assert driver.find_element(By.CSS_SELECTOR, "#model .sub").text == plain(recipe.text["ko"].sub)
    notes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#strategy-notes .note")]
    assert plain(recipe.text["ko"].strategyNote) in notes
    assert driver.find_element(By.ID, "options-title").text == "옵션"
    assert driver.find_element(By.ID, "fit-title").text == "메모리 적합성"
    assert driver.find_element(By.CSS_SELECTOR, "#axis-spec_decode legend").text == "추측 디코딩"
    assert hash_params(driver)["lang"] == "ko"
    en_keys, ko_keys = driver.execute_script(
        "return [Object.keys(SOUS_I18N.en).sort(), Object.keys(SOUS_I18N.ko).sort()]")
    assert en_keys == ko_keys
    before = shown(driver)
    driver.find_element(By.ID, "lang-en").click()
    assert shown(driver) == before  # the commands do not depend on the language
    assert driver.find_element(By.ID, "options-title").text == "Options"


def test_keyboard_labels_and_narrow_screen(driver, site):
    server = site[0]
    load(driver, server + AT_SHIPPED + "&strategy=aggregated-data-expert-parallel&target=Latency")
    tab = driver.find_element(By.ID, "tab-aggregated-data-expert-parallel")
    tab.send_keys(Keys.ARROW_RIGHT)
    active = driver.switch_to.active_element
    assert active.get_attribute("id") == "tab-aggregated-pipeline-parallel"
    assert active.get_attribute("aria-selected") == "true"
    assert hash_params(driver)["strategy"] == "aggregated-pipeline-parallel"
    driver.execute_script("document.getElementById('opt-reasoning_parser').focus()")
    ActionChains(driver).send_keys(Keys.SPACE).perform()
    assert hash_params(driver)["reasoning_parser"] == "off"
    assert driver.switch_to.active_element.get_attribute("id") == "opt-reasoning_parser"
    driver.execute_script("document.getElementById('opt-lmcache-off').focus()")
    ActionChains(driver).send_keys(Keys.ARROW_RIGHT).perform()
    assert hash_params(driver)["lmcache"] == "cpu"
    unlabelled = driver.execute_script("""
        return Array.from(document.querySelectorAll('input, select, button')).filter(e => {
          const label = e.labels && e.labels.length ? e.labels[0].textContent.trim() : '';
          return !(label || e.getAttribute('aria-label') || e.textContent.trim());
        }).map(e => e.outerHTML);""")
    assert unlabelled == []
    driver.execute_cdp_cmd("Browser.grantPermissions", {
        "origin": server.rstrip("/"),
        "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    copy = driver.find_element(By.CSS_SELECTOR, "#commands .copy")
    copy.click()
    WebDriverWait(driver, 5).until(lambda d: copy.get_attribute("data-copied") == "1")
    assert copy.text == "Copied"
    clip = driver.execute_async_script(
        "const done = arguments[0]; navigator.clipboard.readText().then(done, e => done(`${e}`))")
    assert clip == shown(driver)["process"][0][1]
    driver.set_window_size(360, 1600)
    try:
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0
    finally:
        driver.set_window_size(1280, 1600)


def test_screenshot_artefact(driver, site):
    server = site[0]
    load(driver, server + AT_SHIPPED + "&strategy=prefill-decode-disaggregated&target=Latency")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / "recipe-page.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_recipe_picker_shows_axk2(driver, site):
    """The picker lists every shipped recipe; picking A.X-K2 shows its page, and its commands
    and fit are what `sous recipe plan` / `check` give (one-target strategies, 8 decode ranks)."""
    server = site[0]
    load(driver, server + AT_SHIPPED)
    picker = Select(driver.find_element(By.ID, "recipe-select"))
    names = [o.get_attribute("value") for o in picker.options]
    assert names == [*shipped_names(), EXCL]
    picker.select_by_value("ax-k2")
    assert hash_params(driver)["recipe"] == "ax-k2"
    assert driver.find_element(By.ID, "model-name").text == "A.X-K2"
    rec = dict(lmcache="rds", prefix_caching="on_sub_block", spec_decode="eagle3",
               reasoning_parser="on", tool_calling="on")
    assert {k: hash_params(driver)[k] for k in rec} == rec  # the recommended selection
    for slug, target, sel in [
            ("prefill-decode-disaggregated", "Latency", rec),
            ("aggregated-pipeline-parallel", "Throughput",
             dict(lmcache="cpu", prefix_caching="on", spec_decode="eagle3",
                  reasoning_parser="off", tool_calling="off"))]:
        choose(driver, slug, target, sel)
        page = shown(driver)
        assert_shows_plan(page, plan_output("ax-k2", slug, target, sel))
    choose(driver, "prefill-decode-disaggregated", "Latency", rec)
    assert [label for label, _ in shown(driver)["process"]] == [
        "prefill rank 0", *(f"decode rank {i}" for i in range(8))]
    cards = driver.find_elements(By.CSS_SELECTOR, ".fit-card h4")
    assert [c.text for c in cards] == ["prefill rank 0", "decode ranks 0-7"]
    driver.set_window_size(360, 1600)
    try:
        assert driver.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth") <= 0
    finally:
        driver.set_window_size(1280, 1600)
