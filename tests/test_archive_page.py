"""The archive page with its statistics, as a person sees it in a real browser
(Debian's Chromium through Playwright).  Screenshots are kept in
tests/artifacts/ (ignored by git) for a person to look at."""

import datetime
import math
import pathlib

import pytest

import campaignapi

archive_page = campaignapi._archive_page  # internal: the page drawn from chosen figures

ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"
START = datetime.datetime(2026, 11, 20, 9)


def realistic_record():
    """A campaign sent at 09:00 to 12,480 people: opens fall off over two
    days, nights are quiet, a few hours have nothing at all (left out, as
    the SQL leaves them out) and one has zeros."""
    timeline = []
    for hour in range(48):
        moment = START + datetime.timedelta(hours=hour)
        night = moment.hour < 6
        opens = 0 if night and hour > 20 else int(2400 * math.exp(-hour / 6) + (0 if night else 30))
        clicks = opens // 7
        if hour in (20, 21, 44):
            continue                      # no events: the hour is missing
        timeline.append({"hour": moment.strftime("%Y-%m-%d %H:00:00"), "opens": str(opens),
                         "clicks": str(clicks)})
    timeline.reverse()                    # order is not the page's assumption
    return {
        "id": "7", "campaign": "7", "recipients": "12480", "sent": "12391", "failed": "89",
        "bounced": "143", "complained": "2", "unsubscribed": "37", "opened": "5120",
        "opens": str(sum(int(p["opens"]) for p in timeline)), "clicked": "1034",
        "clicks": str(sum(int(p["clicks"]) for p in timeline)),
        "links": [
            {"url": "https://shop.example.com/winter-sale?utm_source=newsletter&utm_medium=email",
             "clicks": "912", "clicked": "701"},
            {"url": "https://example.com/?q=<script>alert(1)</script>", "clicks": "3",
             "clicked": "1"},
            {"url": "https://blog.example.com/a/very/long/path/that/has/to/wrap/on/a/phone/"
                    "screen/without/pushing/the/page/sideways/12345", "clicks": "119",
             "clicked": "98"}],
        "timeline": timeline}


def show(page, content, name, width, height):
    """Load the page with no network at all; returns the URLs it asked for."""
    asked = []
    page.route("**/*", lambda route: (asked.append(route.request.url), route.abort()))
    page.set_viewport_size({"width": width, "height": height})
    page.set_content(content, wait_until="load")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return asked


def test_the_archive_page_shows_figures_chart_and_links(page):
    record = realistic_record()
    content = archive_page(record, "Winter sale <2026> & more")
    asked = show(page, content, "archive-desktop", 1200, 900)
    assert asked == []                    # nothing from a CDN, nothing from anywhere
    assert "<script" not in content.lower().replace("&lt;script", "")
    assert page.title() == "Winter sale <2026> & more"
    assert page.locator("h1").inner_text() == "Winter sale <2026> & more"
    assert page.locator("script").count() == 0

    for name in ("recipients", "sent", "failed", "bounced", "complained", "unsubscribed",
                 "opened", "opens", "clicked", "clicks"):
        assert page.locator(f'dd[data-figure="{name}"]').inner_text() == record[name]

    # One bar pair per hour over the whole two days, the empty hours as well.
    buckets = page.locator("svg g.bucket")
    assert buckets.count() == 48
    labels = buckets.evaluate_all("gs => gs.map(g => g.dataset.label)")
    assert labels[0] == "2026-11-20 09:00" and labels[-1] == "2026-11-22 08:00"
    assert labels[20] == "2026-11-21 05:00"
    assert buckets.nth(20).get_attribute("data-opens") == "0"
    assert buckets.nth(0).get_attribute("data-opens") == "2430"
    # The tallest bar is the busiest hour and fills the plot; an empty hour has none.
    heights = page.locator("svg rect.opens").evaluate_all(
        "rs => rs.map(r => r.getBBox().height)")
    assert heights[0] == max(heights) > 150 and heights[20] == 0
    assert heights[1] < heights[0]
    assert page.locator("svg").get_attribute("role") == "img"
    assert "opens in blue" in page.locator("svg desc").text_content()

    # The same numbers as a table for screen readers and copying.
    assert page.locator("details tbody tr").count() == 48
    assert page.locator("details tbody tr").nth(0).locator("td").all_text_contents() == \
        ["2026-11-20 09:00", "2430", "347"]

    links = page.locator("main > table tbody tr")
    assert links.count() == 3
    assert links.nth(1).locator("td").nth(0).inner_text() == \
        "https://example.com/?q=<script>alert(1)</script>"
    assert links.nth(0).locator("td").nth(1).inner_text() == "912"


def test_the_archive_page_fits_a_phone(page):
    show(page, archive_page(realistic_record(), "Winter sale"), "archive-phone", 375, 740)
    overflow = page.evaluate("document.documentElement.scrollWidth - "
                             "document.documentElement.clientWidth")
    assert overflow <= 0
    # The chart is as wide as the phone (no box to scroll sideways, no 640 px
    # minimum), its labels drawn larger so that they stay readable.
    assert page.locator(".chart").evaluate("c => c.scrollWidth <= c.clientWidth")
    assert page.locator("svg").bounding_box()["width"] <= 375
    assert page.locator("svg > g.bucket > text").first.bounding_box()["height"] >= 9
    # Figures sit two to a row rather than one long column or a squeezed row.
    boxes = page.locator(".figures > div").evaluate_all(
        "ds => ds.map(d => d.getBoundingClientRect().top)")
    assert len(set(boxes)) == 5


def test_an_empty_archive_says_so(page):
    show(page, archive_page({"sent": "0", "timeline": [], "links": []}, "Nothing yet"),
         "archive-empty", 800, 600)
    assert page.locator("svg").count() == 0
    assert "No opens or clicks yet." in page.locator("main").inner_text()
    assert "No tracked links." in page.locator("main").inner_text()
    assert page.locator('dd[data-figure="opens"]').inner_text() == "0"


def test_a_long_timeline_is_shown_per_day(page):
    midnight = START.replace(hour=0)
    timeline = [{"hour": (midnight + datetime.timedelta(hours=h)).strftime("%Y-%m-%d %H:00:00"),
                 "opens": "5", "clicks": "1"} for h in range(0, 24 * 60, 5)]
    show(page, archive_page({"timeline": timeline}, "Two months"), "archive-days", 1000, 700)
    assert page.locator("svg g.bucket").count() == 60
    assert page.locator("#chart-title").inner_text() == "Opens and clicks per day"
    assert page.locator("svg g.bucket").nth(0).get_attribute("data-opens") == "25"  # hours 0, 5 ... 20


def test_the_archive_page_shows_each_ab_test_with_its_winner(page):
    record = realistic_record()
    versions = [{"message": "4", "subject": "Winter sale: 20% off <today>", "sent": "1248",
                 "opened": "262", "clicked": "40", "rate": "0.2099"},
                {"message": "5", "subject": "Last days of the winter sale, with a subject long "
                 "enough to wrap on a phone", "sent": "1248", "opened": "337", "clicked": "61",
                 "rate": "0.2700"}]
    record["batches"] = [{"id": "9", "tests": [{"link": "3", "test": {
        "versions": versions, "winner": "5", "decided": "auto",
        "decidedat": "2026-11-20 10:00:00"}}]}]
    content = archive_page(record, "Winter sale")
    for name, width in (("archive-test-desktop", 1200), ("archive-test-phone", 375)):
        assert show(page, content, name, width, 900) == []
        assert page.evaluate("document.documentElement.scrollWidth - "
                             "document.documentElement.clientWidth") <= 0
    table = page.locator('section.tests table[data-test="3"]')
    assert "Batch 9, campaign message 3: chosen automatically at 2026-11-20 10:00:00" in \
        table.locator("caption").inner_text()
    rows = table.locator("tbody tr")
    assert rows.count() == 2
    assert rows.nth(0).locator("td").all_text_contents() == [
        "Winter sale: 20% off <today>", "1248", "262", "40", "0.2099"]
    assert rows.nth(1).get_attribute("class") == "winner"
    assert rows.nth(1).locator("td").nth(0).inner_text().endswith("(winner)")
    # The links table is still the links alone.
    assert page.locator("main > table tbody tr").count() == 3


@pytest.mark.parametrize("record", [
    {"batches": "nonsense"}, {"batches": [None, {"tests": ["x", {"test": "y"}]}]},
    {"batches": [{"tests": [{"link": "<i>x</i>", "test": {"versions": [None, {"x": 1}],
                                                          "decided": "manual"}}]}]},
    {"timeline": [{"hour": "not a time", "opens": "x"}, None, {"hour": "2026-01-01 00:00:00"}],
     "links": ["not a dict", {"url": "<i>x</i>"}], "opens": "<b>1</b>"},
    {"timeline": "nonsense", "links": None},
    {},
])
def test_odd_records_still_make_a_page(record):
    content = archive_page(record, "<Odd>")
    assert "<b>" not in content and "<i>" not in content and "<Odd>" not in content
    assert content.startswith("<!doctype html>")
