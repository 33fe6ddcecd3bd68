"""Messages and sender profiles: the shared record operations, header values,
and the merge-tag renderer."""

import pytest

import campaignapi
from helpers import fill

MESSAGE = {"name": "Welcome", "subject": "Hello {{firstname}}", "fromname": "Shop",
           "fromaddress": "news@Example.COM", "replyto": "help@example.com",
           "html": "<p>Hi {{firstname}}</p><a href=\"{{unsubscribe_url}}\">stop</a>",
           "text": "Hi {{firstname}}\nStop: {{unsubscribe_url}}"}
PROFILE = {"name": "Main", "fromname": "Shop", "fromaddress": "news@example.com",
           "replyto": "help@example.com"}
KINDS = [("message", MESSAGE), ("accountprofile", PROFILE)]


@pytest.mark.parametrize("kind, values", KINDS)
def test_create_get_change_delete(api, kind, values):
    new_id = api.put(f"/{kind}/0", **values)["id"]
    record = api.get(f"/{kind}/{new_id}")[kind]
    expected = {**values, "fromaddress": "news@example.com"}  # domain lower-cased
    assert {name: record[name] for name in values} == expected
    assert record["id"] == new_id and record["deleted"] == "0" and record["owner"] == "1"

    assert api.post(f"/{kind}/{new_id}", name="Renamed", fromname="Other") is True
    record = api.get(f"/{kind}/{new_id}")[kind]
    assert (record["name"], record["fromname"], record["replyto"]) == \
        ("Renamed", "Other", "help@example.com")

    assert api.delete(f"/{kind}/{new_id}") is True
    assert api.get(f"/{kind}/{new_id}")[kind]["deleted"] == "1"
    assert api.get(f"/{kind}/all")["total"] == "0"
    error = api.post(f"/{kind}/{new_id}", status=409, name="x")
    assert error["error"] == "conflict"
    api.delete(f"/{kind}/{new_id}", status=409)


@pytest.mark.parametrize("kind, values", KINDS)
def test_listing_and_chosen_ids(api, kind, values):
    assert api.put(f"/{kind}/40", **values)["id"] == "40"
    assert api.put(f"/{kind}/0", name="next")["id"] == "41"
    assert api.put(f"/{kind}/40", name="again", status=409)["error"] == "conflict"
    page = api.get(f"/{kind}/all", limit=1, offset=1)
    assert page["total"] == "2" and [r["id"] for r in page[kind]] == ["41"]
    assert (page["limit"], page["offset"]) == ("1", "1")


@pytest.mark.parametrize("kind, values", KINDS)
def test_other_accounts_see_nothing(api, stranger_api, kind, values):
    new_id = api.put(f"/{kind}/0", **values)["id"]
    stranger_api.get(f"/{kind}/{new_id}", status=404)
    stranger_api.post(f"/{kind}/{new_id}", status=404, name="mine")
    stranger_api.delete(f"/{kind}/{new_id}", status=404)
    assert stranger_api.get(f"/{kind}/all")["total"] == "0"
    assert api.get(f"/{kind}/{new_id}")[kind]["name"] == values["name"]


@pytest.mark.parametrize("kind", ["message", "accountprofile"])
@pytest.mark.parametrize("header", ["name", "fromname", "fromaddress", "replyto"])
@pytest.mark.parametrize("value", ["a\r\nBcc: victim@example.com", "line\nbreak", "cr\ronly"])
def test_header_values_with_line_breaks_are_refused(api, kind, header, value):
    error = api.put(f"/{kind}/0", status=400, **{header: value})
    assert error["field"] == header
    new_id = api.put(f"/{kind}/0", name="ok")["id"]
    assert api.post(f"/{kind}/{new_id}", status=400, **{header: value})["field"] == header
    assert api.get(f"/{kind}/{new_id}")[kind][header] in ("ok", "")


def test_subject_with_line_break_is_refused_but_bodies_may_have_them(api):
    assert api.put("/message/0", status=400, subject="Hi\r\nX-Evil: 1")["field"] == "subject"
    new_id = api.put("/message/0", html="<p>\r\n</p>", text="two\nlines")["id"]
    assert api.get(f"/message/{new_id}")["message"]["text"] == "two\nlines"


@pytest.mark.parametrize("kind", ["message", "accountprofile"])
def test_addresses_are_checked(api, kind):
    for bad in ("not an address", "a@b", "Shop <news@example.com>"):
        assert api.put(f"/{kind}/0", status=400, fromaddress=bad)["error"] == "invalid_parameter"
        assert api.put(f"/{kind}/0", status=400, replyto=bad)["field"] == "replyto"
    new_id = api.put(f"/{kind}/0", fromaddress="a@example.com")["id"]
    api.post(f"/{kind}/{new_id}", fromaddress="")  # clearing is allowed
    assert api.get(f"/{kind}/{new_id}")[kind]["fromaddress"] == ""


def test_unknown_parameters_and_delete_id(api):
    assert api.put("/message/0", status=400, subjet="typo")["error"] == "unknown_parameter"
    new_id = api.put("/message/0", name="m")["id"]
    assert api.delete(f"/message/{new_id}", status=409, id=int(new_id) + 1)["field"] == "id"
    assert api.delete(f"/message/{new_id}", id=int(new_id)) is True


def test_levels(client, make_key):
    from conftest import Api
    read_only = Api(client, make_key(levels=["read"]))
    assert read_only.put("/message/0", status=403, name="x")["error"] == "insufficient_access"
    full = Api(client, make_key())
    new_id = full.put("/message/0", name="x")["id"]
    read_only.post(f"/message/{new_id}", status=403, name="y")
    read_only.delete(f"/message/{new_id}", status=403)
    assert read_only.get(f"/message/{new_id}")["message"]["name"] == "x"


# The renderer ---------------------------------------------------------------

def test_render_escapes_values_in_html_only():
    values = {"Name": "<b>Tom & \"Jerry\"</b>", "email": "t@example.com"}
    template = "Dear {{ name }} ({{EMAIL}})"
    assert fill(template, values, as_html=True) == \
        "Dear &lt;b&gt;Tom &amp; &quot;Jerry&quot;&lt;/b&gt; (t@example.com)"
    assert fill(template, values) == "Dear <b>Tom & \"Jerry\"</b> (t@example.com)"


def test_render_runs_no_template_code():
    template = "{{ __import__('os').system('false') }}{% for x in y %}{{7*7}}{{ name.upper() }}"
    assert fill(template, {"name": "x"}) == "{% for x in y %}"
    # A value that looks like a tag is inserted as it is, not rendered again.
    assert fill("{{a}}", {"a": "{{b}}", "b": "no"}) == "{{b}}"


def test_merge_tags_are_found_without_case():
    template = "{{First Name}} {{ email }} {{unsubscribe_url}} {{x}}"
    # internal: the merge-tag reader itself
    assert campaignapi._merge_tags(template) == {"first name", "email", "unsubscribe_url", "x"}
    # internal: the merge-tag reader itself
    assert campaignapi._merge_tags(None) == set()
