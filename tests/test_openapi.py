"""The OpenAPI document: valid, complete, and true to what the app answers."""

import re

import jsonschema
import pytest
import webtest
from openapi_spec_validator import validate

import campaignapi
from conftest import Api
from helpers import build_world, keyed_client, send

METHODS = ("get", "put", "post", "delete")


@pytest.fixture
def document(client):
    response = client.get("/v1/openapi.json")  # no key needed
    assert response.content_type == "application/json"
    assert response.headers["X-Response-Id"]
    return response.json


def operations(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    validate(document)


def test_every_route_of_the_app_is_in_the_document_and_nothing_else(app, document):
    # The two catch-all routes only answer 404/405 in our envelope; the
    # root only redirects to the index.
    served = {(route.method, route.rule) for route in app.routes
              if route.method != "ANY" and route.name != "root"}
    described = {(method, re.sub(r"\{(\w+)\}", r"<\1>", path))
                 for method, path, _ in operations(document)}
    assert served == described
    assert len(served) == len(campaignapi.ROUTES)


def test_a_route_added_to_the_table_appears_without_touching_the_generator(monkeypatch, db):
    def probe(call, thing):
        return True

    extra = campaignapi.Route("POST", "/probe/{thing:int|all}/x/{name:name}", "write", probe,
                              "flavour:a|b! count:int tags:list")
    # internal: the added route's parameter needs its documentation where the generator looks
    monkeypatch.setitem(campaignapi._PARAM_DOCS, "flavour", ("A taste.", "a"))
    monkeypatch.setattr(campaignapi, "ROUTES", [*campaignapi.ROUTES, extra])
    document = webtest.TestApp(campaignapi.create_app(db)).get("/v1/openapi.json").json
    validate(document)
    operation = document["paths"]["/v1/probe/{thing}/x/{name}"]["post"]
    assert operation["x-access-level"] == "write"
    assert operation["summary"] == "Change probe x"
    path_params = {p["name"]: p for p in operation["parameters"] if p["in"] == "path"}
    assert re.fullmatch(path_params["thing"]["schema"]["pattern"], "all")
    assert re.fullmatch(path_params["thing"]["schema"]["pattern"], "12")
    assert not re.fullmatch(path_params["thing"]["schema"]["pattern"], "import")
    assert path_params["name"]["schema"] == {"type": "string", "minLength": 1}
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["flavour"]
    assert body["properties"]["flavour"]["enum"] == ["a", "b"]
    assert body["properties"]["tags"]["type"] == "array"
    # A POST takes its parameters in the body; the document says so only there.
    assert {p["name"] for p in operation["parameters"] if p["in"] == "query"} == set()
    assert body["properties"]["flavour"]["description"] == "A taste."
    assert operation["requestBody"]["content"]["application/json"]["example"]["flavour"] == "a"
    assert "description" not in body["properties"]["count"]    # not in PARAM_DOCS: none
    assert operation["operationId"] == "change_probe_x"
    assert set(operation["responses"]) == {"200", "400", "401", "403", "404", "409", "413",
                                           "415", "422", "500"}


def _route_word(route):
    return [word for word in route.path.split("/") if word and "{" not in word][-1]


def test_a_record_kind_is_described_in_its_resource_and_nowhere_else(document):
    """A record kind is declared in schema.sql, its Resource(...) and its
    lines of ROUTES (issue 25): its record's schema is the Resource's
    ``fields`` and its own parameters' documentation the Resource's ``doc``,
    never entries of the OpenAPI banner's RECORD_SCHEMAS or PARAM_DOCS."""
    kinds = list(campaignapi.Resource.kinds.values())
    schemas = document["components"]["schemas"]
    for kind in kinds:
        assert kind.fields, f"{kind.name}: declare its record's schema as fields="
        assert schemas[kind.schema] == kind.fields, kind.name
    # internal: the answers no record kind owns
    assert not {kind.schema for kind in kinds} & set(campaignapi._RECORD_SCHEMAS)
    # internal: the answers no record kind owns
    assert not {kind.name for kind in kinds} & set(campaignapi._RECORD_SCHEMAS)
    # Who uses each parameter name: the kinds (by name), None for a route of no kind.
    users, words = {}, {_route_word(route) for route in campaignapi.ROUTES if route.kind}
    for route in campaignapi.ROUTES:
        for name in route.params:
            users.setdefault(name, set()).add(route.kind and route.kind.name)
        if route.kind:   # a kind documents only parameters it has
            assert set(route.kind.doc) <= {name for other in campaignapi.ROUTES
                                           if other.kind is route.kind for name in other.params}
    # internal: the parameter docs no kind owns
    for key in campaignapi._PARAM_DOCS:
        word, _, name = key.rpartition(".")
        assert word not in words | set(campaignapi.Resource.kinds), \
            f"PARAM_DOCS[{key!r}] is {word}'s: describe it in that Resource's doc="
        assert word or None in users.get(name, ()) or len(users.get(name, ())) > 1, \
            f"PARAM_DOCS[{key!r}] is used by {sorted(users.get(name, ()))} only: " \
            "describe it in that Resource's doc= (or drop it if no route has it)"


def test_every_parameter_type_has_a_schema():
    # A type added to the pipeline must be described too.
    # internal: two tables of the module that must agree
    assert set(campaignapi._PARAM_TYPES) <= set(campaignapi._PARAM_SCHEMAS)


def test_every_parameter_is_described_with_an_example(document):
    for method, path, operation in operations(document):
        body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        for name, schema in body.get("schema", {}).get("properties", {}).items():
            assert schema.get("description"), (method, path, name)
            assert name in body["example"], (method, path, name)
        for parameter in operation["parameters"]:
            assert parameter.get("description") or parameter["schema"].get("description"), \
                (method, path, parameter["name"])
            assert "example" in parameter, (method, path, parameter["name"])
        assert re.fullmatch(r"[a-z_]+", operation["operationId"]), operation["operationId"]
    ids = [operation["operationId"] for _, _, operation in operations(document)]
    assert len(ids) == len(set(ids))


def test_every_success_answer_is_typed(document):
    for method, path, operation in operations(document):
        success = [answer for status, answer in operation["responses"].items()
                   if status.startswith(("2", "3"))]
        assert len(success) == 1, (method, path)
        for content in success[0].get("content", {}).values():
            data = content["schema"].get("properties", {}).get("data", content["schema"])
            assert "type" in data or "$ref" in data or "oneOf" in data, (method, path)
        if not success[0].get("content"):   # a redirect or an empty answer: its headers say
            assert success[0].get("headers") or method == "OPTIONS", (method, path)


def test_gets_that_change_data_are_marked(document):
    marked = {path for method, path, operation in operations(document)
              if method == "GET" and operation["x-changes-data"]}
    assert marked == {"/v1/datasource/{parent_id}/modify/{child_id}",
                      "/v1/datasource/{parent_id}/export/{child_id}"}
    for path in marked:
        assert "This GET changes data" in document["paths"][path]["get"]["description"]


def test_levels_and_security_follow_the_route_table(document):
    routes = {(r.method, "/v1" + re.sub(r"\{(\w+)(:[\w|]+)?\}", r"{\1}", r.path)): r
              for r in campaignapi.ROUTES}
    for method, path, operation in operations(document):
        route = routes[method, path]
        assert operation["x-access-level"] == route.level
        if route.level:
            assert operation["security"] == [{"bearer": []}]
            assert f"'{route.level}' level" in operation["description"]
            assert {"401", "403"} <= set(operation["responses"])
        else:
            assert operation["security"] == []
            # Only a provider callback, authenticated its own way, answers 401 without a key.
            assert ("401" in operation["responses"]) == (401 in route.errors)
        if route.body:   # a route that reads its body itself describes it
            assert operation["requestBody"] == route.body
            continue
        body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        query = {p["name"]: p for p in operation["parameters"] if p["in"] == "query"}
        given = query if method in ("GET", "DELETE") else body.get("schema", {}).get(
            "properties", {})
        assert set(given) == set(route.params)
        if method in ("GET", "DELETE"):
            assert not body
            assert {name for name, p in query.items() if p["required"]} == \
                {p.name for p in route.params.values() if p.required}
        else:
            assert not query
            assert sorted(body.get("schema", {}).get("required", [])) == \
                sorted(p.name for p in route.params.values() if p.required)
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "An API key's secret."}


def test_every_error_code_is_described(document):
    expected = {400: {"invalid_json", "missing_parameter", "invalid_parameter",
                      "unknown_parameter", "invalid_identifier", "invalid_host"},
                401: {"unauthorized"}, 403: {"insufficient_access"}, 404: {"not_found"},
                405: {"method_not_allowed"}, 409: {"conflict", "verification_failed"},
                413: {"payload_too_large"}, 415: {"unsupported_media_type"},
                422: {"invalid_data", "idempotency_key_reused"}, 500: {"internal_error"}}
    responses = document["components"]["responses"]
    for status, codes in expected.items():
        ref = responses[str(status)]["content"]["application/json"]["schema"]["$ref"]
        schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert schema["properties"]["success"] == {"type": "boolean", "enum": [False]}
        assert set(schema["properties"]["data"]["properties"]["error"]["enum"]) == codes


class Checker:
    """Validates real answers against the document's schema for their operation."""

    def __init__(self, document):
        self.document = document

    def check(self, method, path, response):
        operation = self.document["paths"][path][method.lower()]
        answer = operation["responses"][str(response.status_int)]
        if "$ref" in answer:
            answer = self.document["components"]["responses"][answer["$ref"].rsplit("/", 1)[1]]
        schema = {**answer["content"]["application/json"]["schema"],
                  "components": self.document["components"]}
        if "$ref" in schema:
            schema = {**self.document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]],
                      "components": self.document["components"]}
        jsonschema.validate(response.json, schema, cls=jsonschema.Draft202012Validator)


def test_real_answers_match_the_documented_schemas(client, auth, document):
    checker = Checker(document)

    def call(method, url, path, params=None, headers=auth, status=200):
        response = send(client, method, url, headers, params)
        assert response.status_int == status, response.text
        checker.check(method, path, response)
        return response.json["data"]

    created = call("PUT", "/v1/datasource/0", "/v1/datasource/{id}",
                   {"name": "List", "origin": "import", "fields": [{"name": "age", "type": "integer"}]})
    ds = created["id"]
    call("POST", f"/v1/datasource/{ds}", "/v1/datasource/{id}", {"description": "d"})
    for selector in (ds, "all", "import"):
        call("GET", f"/v1/datasource/{selector}", "/v1/datasource/{id}")
    call("PUT", "/v1/campaign/0", "/v1/campaign/{id}", {"name": "C", "accountprofile": 1})
    call("POST", "/v1/campaign/1", "/v1/campaign/{id}", {"archiveemail": "a@example.com"})
    call("GET", "/v1/campaign/1", "/v1/campaign/{id}")
    call("GET", "/v1/campaign/all", "/v1/campaign/{id}")
    call("DELETE", "/v1/campaign/1", "/v1/campaign/{id}")
    call("GET", "/v1/campaign/1", "/v1/campaign/{id}")              # deleted, still read
    call("DELETE", f"/v1/datasource/{ds}", "/v1/datasource/{id}", {"id": int(ds)})
    # errors
    call("GET", "/v1/campaign/all", "/v1/campaign/{id}", headers={}, status=401)
    call("GET", "/v1/campaign/99", "/v1/campaign/{id}", status=404)
    call("GET", "/v1/campaign/x", "/v1/campaign/{id}", status=400)
    call("PUT", "/v1/campaign/0", "/v1/campaign/{id}", {"name": "C"}, status=400)
    call("PUT", "/v1/campaign/5", "/v1/campaign/{id}", {"name": "C", "accountprofile": 1})
    call("PUT", "/v1/campaign/5", "/v1/campaign/{id}", {"name": "C", "accountprofile": 1},
         status=409)


def test_the_document_is_made_once_per_app_and_names_its_server(app, client):
    first = client.get("/v1/openapi.json").json
    assert first["servers"] == [{"url": "http://localhost:80"}]
    assert app.config["campaignapi.service"].openapi is not None
    assert client.get("/v1/openapi.json").json == first
    public = webtest.TestApp(campaignapi.create_app(
        app.config["campaignapi.service"].db, public_url="https://mail.example.com/api/"))
    assert public.get("/v1/openapi.json").json["servers"] == [
        {"url": "https://mail.example.com/api"}]


def test_a_browser_also_gets_the_raw_document(client):
    response = client.get("/v1/openapi.json", headers={"Accept": "text/html"})
    assert response.content_type == "application/json"
    assert response.json["openapi"].startswith("3.1")
    assert response.headers["Access-Control-Allow-Origin"] == "*"


# --- where the document and the server disagreed (an outside schemathesis run) ---------------

def body_schema(document, method, path):
    """The JSON body schema of an operation, with the document's components."""
    schema = document["paths"][path][method.lower()]["requestBody"]["content"][
        "application/json"]["schema"]
    return {**schema, "components": document["components"]}


def documented(schema, body):
    return jsonschema.Draft202012Validator(schema).is_valid(body)


@pytest.fixture
def templated(db, tmp_path):
    """A client and key of an app with a templates folder, a template (id 1)
    and a campaign (id 1)."""
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "news.html").write_text("<div>{{content}}</div>")
    client, auth = keyed_client(db, templates_dir=str(folder))
    api = Api(client, auth)
    api.put("/template/0", name="t", html="{{content}}")
    api.put("/campaign/0", name="c", accountprofile=1)
    return client, auth


@pytest.mark.parametrize("value", [
    1, 1.0, "1", "0001", 99, "", " ", "news", "news.html", "later", "a\xa0b", "Nyhet ø",
    1.5, -1, 2**70, 1e300, True, "9" * 25, ".html", " .HTML ", "a\u2028b", "a\x85b",
    "a\u202eb", "../x", "a/b", "a\\b", "a\x07b"])
def test_defaulttemplate_is_refused_exactly_where_the_document_says(templated, value):
    # The document typed it string-or-number; a JSON number (1.5, -1, 2**70)
    # was refused with 400 although it fits "number".
    client, auth = templated
    document = client.get("/v1/openapi.json").json
    for method, path, extra in (("PUT", "/v1/campaign/{id}", {"name": "c", "accountprofile": 1}),
                                ("POST", "/v1/campaign/{id}", {})):
        body = {**extra, "defaulttemplate": value}
        response = send(client, method, path.replace("{id}", "1" if method == "POST" else "0"),
                        auth, body)
        assert response.status_int in (200, 400, 404, 409), response.text
        assert (response.status_int != 400) == documented(
            body_schema(document, method, path), body), (value, response.text)


def test_a_test_send_elsewhere_than_send_0_is_a_documented_answer(api, client, auth):
    # The document allows "test" at any {child_id}; the server refused it
    # with 400 at send/1 (a test send makes no batch: API.md section 11).
    build_world(api, send=False)
    document = client.get("/v1/openapi.json").json
    schema = body_schema(document, "PUT", "/v1/campaign/{parent_id}/send/{child_id}")
    body = {"test": ["me@example.com"]}
    assert documented(schema, body)
    data = api.put("/campaign/1/send/1", status=404, **body)
    assert data["error"] == "not_found" and "/campaign/1/send/0" in data["message"]
    assert "404" in document["paths"]["/v1/campaign/{parent_id}/send/{child_id}"]["put"][
        "responses"]
    assert api.put("/campaign/1/send/0", **body) == {"id": "0"}
    # test and timestamp together: the server refuses it, and so does the document.
    both = {"test": ["me@example.com"], "timestamp": 0}
    assert api.put("/campaign/1/send/0", status=400, **both)["field"] == "timestamp"
    assert not documented(schema, both) and not documented(schema, {})
    assert documented(schema, {"timestamp": 0})


@pytest.mark.parametrize("allow_private", [False, True])
def test_a_webhook_url_is_refused_exactly_where_the_document_says(db, allow_private):
    # A URL to a loopback address was refused with 400 (unless the setting
    # webhook_allow_private) though the document's url allowed it.
    client, auth = keyed_client(db, webhook_allow_private=allow_private)
    document = client.get("/v1/openapi.json").json
    schema = body_schema(document, "PUT", "/v1/webhook/{id}")
    refused_always = ["http://169.254.169.254/latest", "http://[fd00:ec2::254]/",
                      "https://100.100.100.200:8443/x"]
    private = ["http://127.0.0.1:8080/hook", "http://127.1.2.3/", "http://10.0.0.5/",
               "http://172.16.0.1/", "http://172.31.255.255/", "http://192.168.1.1/",
               "http://169.254.0.1/", "http://0.0.0.0/", "http://100.64.0.1/",
               "http://224.0.0.1/", "http://255.255.255.255/", "http://[::1]/",
               "http://[::]/", "http://[fe80::1]/", "http://[FD12:3456::1]:81/",
               "http://[ff02::1]/", "http://localhost:8080/", "http://LocalHost./x",
               "http://127.0.0.1./", "http://192.0.2.7/", "http://198.18.0.1/"]
    public = ["http://93.184.216.34/hook", "https://8.8.8.8:8443/", "http://172.32.0.1/",
              "http://[2606:4700::1111]/", "http://100.128.0.1/", "http://11.0.0.1/",
              "http://1.127.0.0/"]
    for url in refused_always + private + public:
        response = send(client, "PUT", "/v1/webhook/0", auth, {"url": url})
        accepted = response.status_int == 200
        assert accepted == (url in public or (allow_private and url in private)), \
            (url, response.text)
        assert accepted == documented(schema, {"url": url}), (url, response.text)
        if not accepted:
            assert response.json["data"]["field"] == "url"


def test_every_address_the_document_refuses_the_server_refuses():
    # The document types the literal addresses a webhook may not call; it
    # must never refuse one the server takes.  Boundaries and neighbours of
    # every range the pattern names, and the metadata addresses.
    import ipaddress

    samples = set()
    for first in range(256):
        for second in (0, 1, 15, 16, 31, 32, 63, 64, 127, 128, 168, 169, 254, 255):
            samples.update({f"{first}.{second}.0.0", f"{first}.{second}.255.255",
                            f"{first}.{second}.100.200"})
    samples.update(["192.0.0.192", "198.51.100.1", "203.0.113.9", "192.0.2.0"])
    for prefix in ("::", "::1", "::2", "fe80::", "febf::1", "fec0::", "fc00::", "fdff::1",
                   "fe7f::1", "fbff::1", "ff00::", "feff::1", "2001:db8::1", "2606:4700::1111",
                   "64:ff9b::7f00:1", "::ffff:7f00:1", "fd00:ec2::254", "fd00:ec2::23"):
        samples.add(prefix)
    for allow_private in (False, True):
        # internal: the document's rule for webhook URLs, against the server's
        refused = campaignapi._webhook_url_schema(allow_private)["not"]["pattern"]
        for address in sorted(samples):
            host = f"[{address}]" if ":" in address else address
            url = f"http://{host}/hook"
            if re.search(refused, url):
                with pytest.raises(ValueError):
                    # internal: the URL rule itself, on addresses no DNS here can give
                    campaignapi._check_webhook_url(url, allow_private=allow_private)
        assert not re.search(refused, "http://" + str(ipaddress.ip_address("8.8.8.8")))


@pytest.mark.parametrize("name", ["\x00", " \x00 ", "a\x00", "\x00b", "city", " town "])
def test_a_nul_in_a_field_name_or_a_condition_value_is_refused_where_documented(api, client,
                                                                                name):
    # The document's patterns took a NUL as the one non-blank character their
    # middle class needs ("\S"); the server refuses a NUL anywhere.
    document = client.get("/v1/openapi.json").json
    body = {"name": "d", "fields": [{"name": name}]}
    status = send(client, "PUT", "/v1/datasource/0", api.headers, body).status_int
    assert (status != 400) == documented(body_schema(document, "PUT", "/v1/datasource/{id}"),
                                         body), status
    ds = api.put("/datasource/0", name="e", fields=[{"name": "city"}])["id"]
    body = {"name": "s", "datasources": [int(ds)],
            "conditions": [{"field": "city", "op": "eq", "value": name}]}
    status = send(client, "PUT", "/v1/segment/0", api.headers, body).status_int
    assert (status != 400) == documented(body_schema(document, "PUT", "/v1/segment/{id}"),
                                         body), status
