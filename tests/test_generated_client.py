"""A client generated from the served OpenAPI document (openapi-python-client)
builds a campaign from nothing until verify passes, with typed requests,
typed answers and typed errors, and nothing else: no hand-written HTTP."""

import importlib
import json
import os
import re
import subprocess
import sys

import pytest

import campaignapi
from clihelpers import ROOT
from helpers import http


def readme_config():
    """The openapi-python-client configuration that the README gives."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("<!-- openapi-python-client config"):]
    block = re.match(r"[^\n]*\n```json\n(.*?)^```$", section, re.S | re.M)
    return json.loads(block[1])


def test_the_readme_gives_the_configuration_for_the_two_media_types():
    config = readme_config()
    assert config == {"content_type_overrides": {
        "image/gif": "application/octet-stream", "message/rfc822": "application/octet-stream",
        "application/atom+xml": "application/octet-stream"}}
    # Every media type the document answers or takes besides JSON, pages,
    # CSV text and forms has its override.
    document = json.dumps(campaignapi.openapi_document())
    media = set(re.findall(r'"([a-z]+/[a-z0-9.+-]+)": \{"schema"', document))
    assert media - {"application/json", "text/html", "text/csv",
                    "application/x-www-form-urlencoded"} == set(config["content_type_overrides"])


@pytest.fixture
def generated(live_server, tmp_path, monkeypatch):
    """The package generated from the live server's document, imported."""
    document = tmp_path / "openapi.json"
    document.write_bytes(http(live_server + "/v1/openapi.json")[2])
    # Media types the generator has no reader for (the open image, a raw bounce
    # email) are bytes to it: the README's configuration says so, and a user
    # who copies it gets the operations this test gets.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(readme_config()))
    run = subprocess.run(["openapi-python-client", "generate", "--path", str(document),
                          "--config", str(config), "--meta", "none",
                          "--output-path", str(tmp_path / "campaignapi_client")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    # Every operation generated, no warning about the document.
    assert "warning" not in (run.stdout + run.stderr).lower(), run.stdout + run.stderr
    assert run.stdout.strip() == f"Generating {tmp_path / 'campaignapi_client'}", run.stdout
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name.startswith("campaignapi_client")]:
        del sys.modules[name]
    return importlib.import_module("campaignapi_client")


def test_every_operation_is_generated(generated, tmp_path):
    functions = {path.stem for path in (tmp_path / "campaignapi_client" / "api").rglob("*.py")
                 if path.stem != "__init__"}
    document = campaignapi.openapi_document()
    ids = {operation["operationId"] for item in document["paths"].values()
           for operation in item.values()}
    assert functions == ids and len(ids) == len(campaignapi.ROUTES)


def test_a_campaign_from_nothing_with_only_the_generated_client(generated, live_server, db):
    def use(name):
        return importlib.import_module(f"campaignapi_client.{name}")

    models = use("models")

    class api:   # the generated modules, by tag
        pass

    for tag, names in {"index": ["get_index"], "accountprofile": ["create_accountprofile"],
                       "datasource": ["create_datasource", "create_datasource_import",
                                      "get_datasource_import"],
                       "message": ["create_message"], "segment": ["create_segment", "get_segment"],
                       "campaign": ["create_campaign", "get_campaign", "get_campaign_verify",
                                    "create_campaign_message"]}.items():
        group = type(tag, (), {})
        for name in names:
            setattr(group, name, use(f"api.{tag}.{name}"))
        setattr(api, tag, group)
    secret = campaignapi.create_key(db, "owner@example.com", campaignapi.LEVELS)
    client = generated.AuthenticatedClient(base_url=live_server, token=secret,
                                           raise_on_unexpected_status=True)
    anonymous = generated.Client(base_url=live_server, raise_on_unexpected_status=True)

    index = api.index.get_index.sync(client=anonymous)
    assert isinstance(index, models.GetIndexResponse200)
    assert index.data.openapi == "openapi.json"

    profile = api.accountprofile.create_accountprofile.sync("0", client=client,
        body=models.CreateAccountprofileBody(name="Shop", fromname="The Shop",
                                             fromaddress="news@shop.example"))
    assert isinstance(profile, models.CreateAccountprofileResponse200)
    datasource = api.datasource.create_datasource.sync("0", client=client,
        body=models.CreateDatasourceBody(name="Customers", fields=[
            models.CreateDatasourceBodyFieldsItem(
                name="city", type_=models.CreateDatasourceBodyFieldsItemType.TEXT)]))
    ds = datasource.data.id
    imported = api.datasource.create_datasource_import.sync(ds, "0", client=client,
        body=models.CreateDatasourceImportBody(
            name="first", originalfile="people.csv",
            field_uploadtype=models.CreateDatasourceImportBodyUploadtype.CSV,
            field_uploaddata="email,city\nann@example.com,Oslo\nbob@example.com,Rome\n"))
    assert isinstance(imported, models.CreateDatasourceImportResponse200)
    record = api.datasource.get_datasource_import.sync(ds, imported.data.id, client=client)
    assert record.data.import_.inserted == "2"
    message_body = models.CreateMessageBody(
        name="Hello", subject="News for {{city}}",
        html='<p>Hi {{city}}</p><a href="{{unsubscribe_url}}">Unsubscribe</a>',
        text="Hi {{city}}\nUnsubscribe: {{unsubscribe_url}}")
    # The Idempotency-Key header is an argument: a retry gets the same message.
    message = api.message.create_message.sync("0", client=client, body=message_body,
                                              idempotency_key="hello-message")
    retried = api.message.create_message.sync_detailed("0", client=client, body=message_body,
                                                       idempotency_key="hello-message")
    assert retried.parsed.data.id == message.data.id
    assert retried.headers["Idempotent-Replayed"] == "true"
    segment = api.segment.create_segment.sync("0", client=client, body=models.CreateSegmentBody(
        name="Oslo", datasources=[int(ds)], match=models.CreateSegmentBodyMatch.ALL,
        conditions=[models.CreateSegmentBodyConditionsItemType0(
            field="city", op=models.CreateSegmentBodyConditionsItemType0Op.EQ, value="Oslo")]))
    got = api.segment.get_segment.sync(segment.data.id, client=client)
    assert got.data.segment.size == "1"
    assert got.data.segment.conditions[0].op == models.SegmentConditionsItemOp.EQ
    campaign = api.campaign.create_campaign.sync("0", client=client, body=models.CreateCampaignBody(
        name="Launch", accountprofile=int(profile.data.id), enabled=True))
    campaign_id = campaign.data.id

    # Typed errors: a failing verify, an unknown record, a bad parameter.
    verify = api.campaign.get_campaign_verify.sync(campaign_id, "0", client=client)
    assert isinstance(verify, models.GetCampaignVerifyResponse200)
    assert verify.data.verify.passed == models.VerifyPassed.VALUE_0
    missing = api.campaign.get_campaign.sync("99", client=client)
    assert isinstance(missing, models.Error404)
    assert missing.data.error == models.Error404DataError.NOT_FOUND
    refused = api.campaign.create_campaign_message.sync(campaign_id, "0", client=client,
        body=models.CreateCampaignMessageBody(segment=int(segment.data.id), message=999))
    assert isinstance(refused, models.Error404), refused
    wrong = api.campaign.get_campaign.sync("all", client=client, limit=5000)
    assert isinstance(wrong, models.Error400)
    assert wrong.data.field == "limit"
    assert wrong.data.error == models.Error400DataError.INVALID_PARAMETER

    link = api.campaign.create_campaign_message.sync(campaign_id, "0", client=client,
        body=models.CreateCampaignMessageBody(segment=int(segment.data.id),
                                              message=int(message.data.id)))
    assert isinstance(link, models.CreateCampaignMessageResponse200)
    verify = api.campaign.get_campaign_verify.sync(campaign_id, "0", client=client)
    assert verify.data.verify.passed == models.VerifyPassed.VALUE_1, json.dumps(
        verify.to_dict()["data"]["verify"]["checks"])
    assert all(check.passed == models.CheckPassed.VALUE_1 for check in verify.data.verify.checks)
