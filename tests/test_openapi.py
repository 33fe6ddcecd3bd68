"""The OpenAPI document: valid, complete, and true to what the app answers."""

import re

import jsonschema
import pytest
import webtest
from openapi_spec_validator import validate

import campaignapi
from helpers import send

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
    monkeypatch.setitem(campaignapi.PARAM_DOCS, "flavour", ("A taste.", "a"))
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


def test_every_parameter_type_has_a_schema():
    # A type added to the pipeline must be described too.
    assert set(campaignapi.PARAM_TYPES) <= set(campaignapi._PARAM_SCHEMAS)


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
                422: {"invalid_data"}, 500: {"internal_error"}}
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
