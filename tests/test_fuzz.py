"""Fuzzing: schemathesis against the served OpenAPI document (every
operation, positive and negative data: no 5xx, every answer as documented)
and Hypothesis properties of the CSV importer and the merge-tag renderer."""

import base64
import csv
import io
import json
import os
import urllib.parse

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from schemathesis import checks as st_checks

import webtest

import campaignapi
from conftest import Api
from helpers import (build_world, fill, get_import, keyed_client, new_idempotency_key,
                     recipients)

#: Bounded for CI: examples per operation and generation mode.
FUZZ_EXAMPLES = int(os.environ.get("CAMPAIGNAPI_FUZZ_EXAMPLES", "12"))

#: The same examples on every run, so CI is reproducible; set
#: CAMPAIGNAPI_FUZZ_RANDOM=1 (and raise CAMPAIGNAPI_FUZZ_EXAMPLES) to explore.
BOUNDED = settings(deadline=None, database=None,
                   derandomize=not os.environ.get("CAMPAIGNAPI_FUZZ_RANDOM"),
                   suppress_health_check=list(HealthCheck))


# --- schemathesis -------------------------------------------------------------------------

# The raw email that POST /v1/bounce takes is bytes, sent as they are.
schemathesis.serializer.alias("message/rfc822", "application/octet-stream")


def provider_settings():
    """Every provider callback on, so that its checks (not a 404) meet the fuzzer."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    public = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return {"mailgun_signing_key": "fuzz-key", "postmark_credentials": "fuzz:secret",
            "sendgrid_public_key": public,
            "ses_topic_arns": ["arn:aws:sns:us-east-1:123456789012:fuzz"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An app with records 1 of every kind, its key, and its schemathesis schema."""
    db = str(tmp_path_factory.mktemp("fuzz") / "campaignapi.db")
    client, auth = keyed_client(db, **provider_settings())
    build_world(Api(client, auth))
    # Datasource 1 takes sign-ups, so that the public sign-up routes do more than 404;
    # campaign 1 is public and its batch sent, so that its public archive does too.
    Api(client, auth).post("/datasource/1", signup=1, fromprofile=1)
    Api(client, auth).post("/campaign/1", public=1)
    from smtp_sink import SmtpSink

    sink = SmtpSink().start()
    try:
        campaignapi.process_due(db)
        campaignapi.deliver(db, sink.address)
        campaignapi.process_due(db)   # the batch is sent
    finally:
        sink.stop()
    return client.app, auth, schemathesis.openapi.from_wsgi("/v1/openapi.json", client.app)


def operations():
    document = campaignapi.openapi_document()
    for path, methods in document["paths"].items():
        for method in methods:
            if method in ("get", "put", "post", "delete"):
                yield pytest.param(method.upper(), path, id=f"{method.upper()} {path}")


CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance,
          st_checks.content_type_conformance, st_checks.response_schema_conformance]


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method,path", list(operations()))
def test_schemathesis_every_operation_answers_as_documented(served, method, path, mode):
    """No 5xx; status, content type and body (the envelope, or the record
    schemas) as the document says, for valid and for invalid requests."""
    app, auth, schema = served
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @settings(BOUNDED, max_examples=FUZZ_EXAMPLES)
    @given(case=strategy)
    def run(case):
        response = new_idempotency_key(case).call_and_validate(headers=auth, checks=CHECKS)
        if response.headers.get("Content-Type", [""])[0].startswith("application/json") \
                and "openapi" not in path:
            body = json.loads(response.content)
            assert set(body) == {"responseId", "version", "success", "data"}
            assert body["success"] is (response.status_code == 200)

    try:
        run()
    except Exception as error:  # a negative strategy may have nothing to break
        if type(error).__name__ != "Unsatisfiable":
            raise


# --- the CSV importer ---------------------------------------------------------------------

DIALECTS = st.fixed_dictionaries({
    "delimiter": st.sampled_from([",", ";", "\t"]),
    "quoting": st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL, csv.QUOTE_NONNUMERIC]),
    "lineterminator": st.sampled_from(["\r\n", "\n"]),
})
#: Field names a careful user gives columns (the sniffer reads the header
#: line, so a name holding the other delimiters is ambiguous by nature).
FIELD_NAMES = st.from_regex(r"[A-Za-zÀ-ÿ][A-Za-z0-9À-ÿ _]{0,15}", fullmatch=True).map(
    str.strip).filter(lambda n: n and n.lower().replace(" ", "").replace("_", "") not in (
        "email", "emailaddress"))
#: Awkward cell values: quotes, delimiters, newlines, non-ASCII, spaces.
VALUES = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
                 max_size=30) | st.sampled_from([
                     '"', '""', "a,b;c\td", "line\nbreak", "cr\rlf\r\n", " padded ",
                     "=SUM(A1)", "ünïcödé €", "0", "-1", "", "NULL", "\\N"])
LOCALS = st.from_regex(r"[a-z0-9][a-z0-9._+-]{0,12}[a-z0-9]", fullmatch=True).filter(
    lambda s: ".." not in s)


@st.composite
def tables(draw):
    names = draw(st.lists(FIELD_NAMES, min_size=0, max_size=4, unique_by=str.lower))
    addresses = draw(st.lists(LOCALS, min_size=1, max_size=8, unique=True))
    rows = [[f"{local}@example.com"] + [draw(VALUES) for _ in names] for local in addresses]
    return names, rows


def stored(value):
    """A text cell as the API answers it: blank (only Unicode whitespace, as
    str.isspace() has it: NEL and no-break spaces too) is no value."""
    return None if value.strip() == "" else value


def spreadsheet(cell):
    """A text cell as an export writes it: a ' before = + - @ tab or CR (OWASP)."""
    return "'" + cell if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


@pytest.fixture(scope="module")
def importer(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("csv") / "campaignapi.db")
    client, auth = keyed_client(db)
    return client, Api(client, auth), auth


@settings(BOUNDED, max_examples=40)
# A cell of NEL (U+0085) alone: Unicode whitespace, so blank like a space.
@example(table=(["A"], [["00@example.com", "\x85"]]),
         dialect={"delimiter": ",", "quoting": 0, "lineterminator": "\r\n"}, upload="csv")
@given(table=tables(), dialect=DIALECTS,
       upload=st.sampled_from(["csv", "utf-8", "utf-8-sig", "utf-16", "latin-1"]))
def test_csv_round_trip_in_any_dialect(importer, table, dialect, upload):
    """Rows written by csv.writer come back the same through the recipient
    records and through the export's CSV."""
    client, api, _ = importer
    names, rows = table
    # csv.writer quotes a field for the characters of its own line end only:
    # with "\n", a value holding "\r" goes out bare, and reads as a line end.
    assume(dialect["lineterminator"] == "\r\n" or not any("\r" in cell for row in rows
                                                          for cell in row))
    text = io.StringIO(newline="")
    writer = csv.writer(text, **dialect)
    writer.writerow(["email"] + names)
    writer.writerows(rows)
    text = text.getvalue()
    if upload == "csv":
        kind, data = "csv", text
    else:
        try:
            raw = text.encode(upload)
        except UnicodeEncodeError:
            assume(False)
        kind, data = "base64", base64.b64encode(raw).decode()
    ds = api.put("/datasource/0", name="fuzz")["id"]
    answer = api.put(f"/datasource/{ds}/import/0", name="i", originalfile="f.csv",
                     __uploadtype__=kind, __uploaddata__=data)
    record = get_import(api, ds, answer["id"])
    assert (record["inserted"], record["skipped"]) == (str(len(rows)), "0"), record
    listed = {email: record["fields"] for email, record in recipients(api, ds).items()}
    expected = {row[0]: {"email": row[0], **{n: stored(v) for n, v in zip(names, row[1:])}}
                for row in rows}
    assert listed == expected
    url = api.get(f"/datasource/{ds}/export/0")["export"]["url"]
    exported = list(csv.reader(io.StringIO(client.get(urllib.parse.urlsplit(url).path).text,
                                           newline="")))
    assert exported[0] == ["email"] + names
    assert sorted(exported[1:]) == sorted(
        [spreadsheet(row[0])] + [spreadsheet(stored(v) or "") for v in row[1:]] for row in rows)


@settings(BOUNDED, max_examples=60)
@given(data=st.binary(max_size=600) | st.binary(max_size=300).map(
    lambda b: b"email,name\r\n" + b + b"\r\na@example.com,\xff\xfe\r\n"))
@example(data=b"\xff\xfe" + "email\n\ud800".encode("utf-16-le", "surrogatepass"))
@example(data=b"email\x00,x\n\x00@example.com,\x00\n")
@example(data=b'email,"unterminated\na@example.com,x\n')
@example(data=b"sep=\n")
def test_any_bytes_as_a_base64_upload_is_200_or_422(importer, data):
    client, api, auth = importer
    ds = api.put("/datasource/0", name="bytes")["id"]
    response = client.put_json(
        f"/v1/datasource/{ds}/import/0", {
            "name": "i", "originalfile": "f.csv", "__uploadtype__": "base64",
            "__uploaddata__": base64.b64encode(data).decode()},
        headers=auth, expect_errors=True)
    assert response.status_int in (200, 422), response.text
    if response.status_int == 422:
        assert response.json["data"]["error"] == "invalid_data"
        # Nothing was written: no import record, no recipients.
        assert api.get(f"/datasource/{ds}/import/all")["total"] == "0"
        assert api.get(f"/datasource/{ds}/recipient/all")["total"] == "0"


# --- the merge-tag renderer ---------------------------------------------------------------

TAG_NAMES = st.text(st.characters(exclude_characters="{}", exclude_categories=("Cs",)),
                    min_size=1, max_size=12).filter(lambda n: n.strip())
ANY_VALUES = st.dictionaries(TAG_NAMES, st.text(max_size=40) | st.integers() | st.none(),
                             max_size=5)


@settings(BOUNDED, max_examples=200)
@given(template=st.text(max_size=200), values=ANY_VALUES, as_html=st.booleans())
def test_render_never_fails_on_any_template_or_values(template, values, as_html):
    assert isinstance(fill(template, values, as_html=as_html), str)


@settings(BOUNDED, max_examples=200)
@given(template=st.lists(TAG_NAMES.map(lambda n: "{{" + n + "}}") | st.text(
    st.characters(exclude_characters="<>&{}"), max_size=10), max_size=8).map("".join),
       values=ANY_VALUES)
def test_values_are_escaped_in_html(template, values):
    values = {name: f"<script>{value}</script>&\"'" for name, value in values.items()}
    rendered = fill(template, values, as_html=True)
    assert "<" not in rendered and ">" not in rendered
    assert "&" not in rendered.replace("&amp;", "").replace("&lt;", "").replace(
        "&gt;", "").replace("&quot;", "").replace("&#x27;", "")


@settings(BOUNDED, max_examples=200)
@given(name=TAG_NAMES, value=st.text(max_size=60), before=st.text(
    st.characters(exclude_characters="{}"), max_size=10))
def test_text_is_inserted_plain_and_once(name, value, before):
    """Plain text gets the value as it is, never expanded again: a value
    holding a tag stays that text."""
    rendered = fill(before + "{{" + name + "}}", {name.strip(): value})
    assert rendered == before + value


@pytest.mark.parametrize("tag", [
    "{{7*7}}", "{{ 7*7 }}", "{{__class__}}", "{{ name.__class__.__mro__ }}",
    "{{config}}", "{{ self }}", "{{ ''.join(['a']) }}", "{{__import__('os').system('id')}}",
    "{{ {{name}} }}", "{% if 1 %}x{% endif %}", "${7*7}", "{{name|safe}}"])
def test_tags_are_never_evaluated(tag):
    rendered = fill(tag, {"name": "<b>Ann</b>"}, as_html=True)
    assert "49" not in rendered and "class" not in rendered and "uid=" not in rendered
    assert "<b>" not in rendered
    assert fill("{{a}}", {"a": "{{b}}", "b": "X"}) == "{{b}}"


@pytest.mark.parametrize("path,ids", [
    ("/v1/campaign/{parent_id}/message/{child_id}", {"parent_id": 1, "child_id": "all"}),
    ("/v1/campaign/{parent_id}/message/{child_id}", {"parent_id": 1, "child_id": 1}),
    ("/v1/message/{id}", {"id": "all"}), ("/v1/message/{id}", {"id": 1})])
def test_campaign_messages_and_messages_answer_their_own_documented_records(served, path, ids):
    """Both answer under the key "message", but a campaign message is a link
    record, not a message: each must match its own schema (found by fuzzing)."""
    app, auth, schema = served
    case = schema[path]["GET"].Case(path_parameters=ids)
    response = case.call_and_validate(headers=auth, checks=CHECKS)
    assert response.status_code == 200


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_sign_ups_to_a_list_that_takes_them(served, mode):
    """The sign-up post with generated form and JSON bodies, at datasource 1
    (which takes sign-ups), not only at the random ids of the run above."""
    app, auth, schema = served
    # A list of its own: the run above may have changed or deleted the records at id 1.
    api = Api(webtest.TestApp(app), auth)
    profile = api.put("/accountprofile/0", name="p", fromaddress="list@example.com")["id"]
    ds = api.put("/datasource/0", name="signups", signup=1, fromprofile=int(profile))["id"]
    operation = schema["/v1/subscribe/{id}"]["POST"]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @settings(BOUNDED, max_examples=FUZZ_EXAMPLES * 2)
    @given(case=strategy)
    def run(case):
        case.path_parameters = {"id": ds}
        response = new_idempotency_key(case).call_and_validate(checks=CHECKS)
        assert response.status_code in (200, 400, 413, 415, 429), response.content[:300]

    run()
