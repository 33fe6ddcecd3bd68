"""The schema at start-up, and the command line: keys, and a real server."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
import webtest

import campaignapi
from helpers import free_port, http, snapshot

SCRIPT = os.path.abspath(campaignapi.__file__)
SECRET_LINE = re.compile(r"^cak_[A-Za-z0-9_-]+$")


def run_cli(*args, cwd):
    result = subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True,
                            text=True, timeout=60)
    return result


# --- the schema ----------------------------------------------------------------------------

def test_new_database_gets_the_schema_version(db):
    campaignapi.create_app(db)
    conn = campaignapi.connect(db)
    assert conn.schema_version() == campaignapi.SCHEMA_VERSION == 11
    conn.close()
    assert {"account", "apikey", "datasource", "field", "campaign"} <= set(snapshot(db))


def test_existing_database_keeps_its_data(db, api):
    api.put("/campaign/0", name="kept", accountprofile=1)
    secret = api.headers["Authorization"]
    again = webtest.TestApp(campaignapi.create_app(db))
    response = again.get("/v1/campaign/1", headers={"Authorization": secret})
    assert response.json["data"]["emt_campaign"][0]["name"] == "kept"


def test_newer_schema_is_refused(db):
    conn = campaignapi.connect(db)
    conn.set_schema_version(99)
    conn.close()
    with pytest.raises(RuntimeError, match="99"):
        campaignapi.create_app(db)


def test_importing_the_module_creates_nothing(tmp_path):
    here = os.path.dirname(SCRIPT)
    code = "import campaignapi, os; assert not hasattr(campaignapi, 'app'); print(os.listdir('.'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": here,
                                                        "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert os.listdir(tmp_path) == []


# --- key create | list | revoke ------------------------------------------------------------

def test_key_create_list_revoke(tmp_path):
    db = str(tmp_path / "keys.db")
    created = run_cli("key", "create", "--email", "cli@example.com", "--levels", "read",
                      "--name", "reader", "--expires", "2099-01-01", "--db", db, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    assert SECRET_LINE.match(secret)

    client = webtest.TestApp(campaignapi.create_app(db))
    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/campaign/all", headers=headers).json["success"] is True
    denied = client.put_json("/v1/campaign/0", {"name": "x", "accountprofile": 1},
                             headers=headers, expect_errors=True)
    assert denied.status_int == 403

    listed = run_cli("key", "list", "--db", db, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert secret not in listed.stdout
    line, = [line for line in listed.stdout.splitlines() if "cli@example.com" in line]
    assert "read" in line and "reader" in line and "2099-01-01" in line
    key_id = line.split()[0]

    revoked = run_cli("key", "revoke", key_id, "--db", db, cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr
    # Revoked from another process: the app stops accepting it within
    # key_cache_seconds (the setting's documented bound), a fresh app at once.
    fresh = webtest.TestApp(campaignapi.create_app(db))
    assert fresh.get("/v1/campaign/all", headers=headers, expect_errors=True).status_int == 401
    time.sleep(campaignapi.DEFAULT_CONFIG["key_cache_seconds"] + 0.05)
    response = client.get("/v1/campaign/all", headers=headers, expect_errors=True)
    assert response.status_int == 401
    assert "revoked" in run_cli("key", "list", "--db", db, cwd=tmp_path).stdout
    assert os.listdir(tmp_path) != [] and "campaignapi.db" not in os.listdir(tmp_path)


def test_key_create_with_all_levels_by_default(tmp_path):
    db = str(tmp_path / "keys.db")
    created = run_cli("key", "create", "--email", "all@example.com", "--db", db, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    client = webtest.TestApp(campaignapi.create_app(db))
    response = client.put_json("/v1/campaign/0", {"name": "x", "accountprofile": 1},
                               headers={"Authorization": f"Bearer {secret}"})
    assert response.json["data"] == {"id": "1"}


@pytest.mark.parametrize("args", [("create", "--email", "nobody"),
                                  ("create", "--email", "a@example.com", "--levels", "root"),
                                  ("create", "--email", "a@example.com", "--expires", "soon"),
                                  ("revoke", "7")])
def test_key_errors_exit_nonzero(tmp_path, args):
    result = run_cli("key", *args, "--db", str(tmp_path / "k.db"), cwd=tmp_path)
    assert result.returncode != 0
    assert "error" in result.stderr and "Traceback" not in result.stderr
    assert not SECRET_LINE.search(result.stdout)


# --- serve -----------------------------------------------------------------------------------

class Server:
    """``python campaignapi.py --db DB --port PORT`` as a real process."""

    def __init__(self, db, cwd):
        self.port = free_port()
        self.lines = []
        self.process = subprocess.Popen(
            [sys.executable, SCRIPT, "--db", db, "--port", str(self.port)], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def request(self, path, headers=None):
        status, answer_headers, body = http(f"http://127.0.0.1:{self.port}{path}",
                                            headers=headers, timeout=10)
        return status, dict(answer_headers), json.loads(body)

    def wait_ready(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "\n".join(self.lines)
            try:
                return self.request("/v1/campaign/all")
            except (ConnectionError, urllib.error.URLError):
                time.sleep(0.1)
        raise AssertionError("the server did not answer:\n" + "\n".join(self.lines))

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.reader.join(timeout=10)


def test_serve_prints_a_secret_once_and_serves_http(tmp_path):
    db = str(tmp_path / "served.db")
    server = Server(db, tmp_path)
    try:
        status, headers, envelope = server.wait_ready()
        assert status == 401 and envelope["data"]["error"] == "unauthorized"
        assert headers["X-Response-Id"] == envelope["responseId"]
        secrets = [line for line in server.lines if SECRET_LINE.match(line)]
        assert len(secrets) == 1, server.lines
        auth = {"Authorization": f"Bearer {secrets[0]}"}
        status, headers, envelope = server.request("/v1/campaign/all", auth)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert envelope["success"] is True and envelope["version"] == 1
        assert envelope["data"]["emt_campaign"] == []
        status, _, envelope = server.request("/v1/nowhere", auth)
        assert status == 404 and envelope["data"]["error"] == "not_found"
    finally:
        server.stop()
    assert len([line for line in server.lines if SECRET_LINE.match(line)]) == 1

    second = Server(db, tmp_path)
    try:
        status, _, envelope = second.wait_ready()
        assert status == 401
        status, _, envelope = second.request("/v1/campaign/all", auth)
        assert status == 200 and envelope["success"] is True
    finally:
        second.stop()
    assert not [line for line in second.lines if SECRET_LINE.search(line)], second.lines


def test_serve_refuses_a_bad_first_account_address(tmp_path):
    result = run_cli("--db", str(tmp_path / "s.db"), "--port", str(free_port()),
                     "--email", "not-an-address", cwd=tmp_path)
    assert result.returncode != 0
    assert "error" in result.stderr and "Traceback" not in result.stderr
    assert not SECRET_LINE.search(result.stdout)

