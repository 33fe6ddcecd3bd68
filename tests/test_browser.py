"""What a person sees in a real browser (headless Chromium via Playwright)."""

import json


def shown_envelope(page):
    return json.loads(page.locator("#envelope").inner_text())


def test_a_browser_gets_the_error_envelope_as_a_readable_page(live_server, page):
    response = page.goto(f"{live_server}/v1/campaign/all")
    assert response.status == 401
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["x-response-id"]
    assert page.title() == "campaignapi: unauthorized"
    assert page.locator("h1").inner_text() == "unauthorized"
    envelope = shown_envelope(page)
    assert envelope["success"] is False
    assert envelope["data"]["error"] == "unauthorized"
    assert envelope["responseId"] == response.headers["x-response-id"]
    # Pretty-printed: one key per line, indented, and the error in red.
    assert '\n  "success": false,' in page.locator("#envelope").inner_text()
    assert page.locator("h1").evaluate("e => getComputedStyle(e).color") == "rgb(176, 0, 32)"


def test_a_browser_gets_a_404_page_for_an_unknown_route(live_server, page):
    response = page.goto(f"{live_server}/v1/no/such/<b>route</b>")
    assert response.status == 404
    envelope = shown_envelope(page)
    assert envelope["data"]["error"] == "not_found"
    assert "/v1/no/such/<b>route</b>" in envelope["data"]["message"]
    assert page.locator("b").count() == 0      # nothing of the request becomes markup


def test_a_browser_with_a_key_gets_the_success_page(live_server, page, auth):
    page.set_extra_http_headers(auth)
    response = page.goto(f"{live_server}/v1/campaign/all")
    assert response.status == 200
    assert page.locator("h1").inner_text() == "success"
    assert page.locator("h1").evaluate("e => getComputedStyle(e).color") == "rgb(19, 115, 51)"
    assert shown_envelope(page)["data"]["emt_campaign"] == []
