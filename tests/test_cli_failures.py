"""Every start-up and argument failure of ``python campaignapi.py ...``: one line
on stderr, exit status 2, no traceback, nothing printed on stdout, and nothing
created or changed before the options are checked."""

import datetime
import re
import socket
import sqlite3
import urllib.request

import pytest

import campaignapi
from clihelpers import run_cli, served, snapshot


def refused(tmp_path, *args):
    """Run the command in ``tmp_path``; assert the one-line refusal and that
    no file there was created or changed.  Answers the line."""
    before = snapshot(tmp_path)
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("campaignapi"), result.stderr
    assert "error: " in lines[0]
    assert result.stdout == ""   # no banner, no secret
    assert snapshot(tmp_path) == before
    return lines[0]


@pytest.fixture
def existing_db(tmp_path):
    """A campaignapi database with one key (id 1)."""
    db = str(tmp_path / "existing.db")
    campaignapi.create_key(db, "owner@example.com")
    return db


# --- the port, the host ---------------------------------------------------------------

def test_a_port_in_use_is_refused_before_the_database_is_made(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(tmp_path, "serve", "--db", "new.db", "--port", str(port),
                       "--smtp", "127.0.0.1:25")
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


def test_a_host_that_is_not_ours_is_refused(tmp_path):
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine.
    line = refused(tmp_path, "--db", "new.db", "--host", "192.0.2.1", "--port", "0")
    assert "cannot listen on 192.0.2.1:0" in line


# --- the database ---------------------------------------------------------------------

def test_db_in_a_missing_directory(tmp_path):
    line = refused(tmp_path, "serve", "--db", "nowhere/campaigns.db")
    assert "does not exist" in line and "nowhere" in line


def test_db_under_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    assert "is not a directory" in refused(tmp_path, "serve", "--db", "notes.txt/x.db")


def test_db_where_no_file_can_be_made(tmp_path):
    # /proc takes no new files, not even from root (file permissions would not
    # stop root, who runs these tests in CI).
    line = refused(tmp_path, "serve", "--db", "/proc/campaignapi-test.db", "--port", "0")
    assert "cannot create files in /proc" in line


def test_db_that_is_a_directory(tmp_path):
    (tmp_path / "data").mkdir()
    assert "is a directory" in refused(tmp_path, "serve", "--db", "data")


def test_a_file_that_is_not_a_database(tmp_path):
    (tmp_path / "notes.db").write_text("shopping list: milk, eggs\n" * 100)
    for command in (["serve"], ["worker"], ["key", "list"]):
        assert "not a database" in refused(tmp_path, *command, "--db", "notes.db")


def test_a_database_of_a_newer_schema_is_left_alone(tmp_path):
    conn = sqlite3.connect(tmp_path / "future.db")
    conn.execute(f"PRAGMA user_version = {campaignapi.SCHEMA_VERSION + 1}")
    conn.execute("CREATE TABLE account (id INTEGER PRIMARY KEY)")
    conn.close()
    for command in (["serve", "--port", "0"], ["worker"], ["key", "create", "--email",
                                                           "a@example.com"]):
        line = refused(tmp_path, *command, "--db", "future.db")
        assert "newer campaignapi" in line and f"version {campaignapi.SCHEMA_VERSION + 1}" in line


def test_another_applications_database_is_not_touched(tmp_path):
    conn = sqlite3.connect(tmp_path / "shop.db")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    conn.close()
    assert "another application" in refused(tmp_path, "serve", "--db", "shop.db")


def test_worker_refuses_a_database_that_does_not_exist(tmp_path):
    line = refused(tmp_path, "worker", "--db", "typo.db", "--smtp", "127.0.0.1:25")
    assert "typo.db" in line and "no database" in line


def test_key_list_and_revoke_refuse_a_database_that_does_not_exist(tmp_path):
    refused(tmp_path, "key", "list", "--db", "typo.db")
    refused(tmp_path, "key", "revoke", "1", "--db", "typo.db")


# --- delivery options, checked before the database is made -----------------------------

@pytest.mark.parametrize("options, words", [
    (["--smtp", "nohostport"], "host:port"),
    (["--smtp", "relay:99999"], "host:port"),
    (["--connections", "0"], "--connections"),
    (["--connections", "many"], "--connections"),
    (["--rate", "-1"], "--rate"),
    (["--rate", "0"], "--rate"),
    (["--rate", "nan"], "--rate"),
    (["--mail-from", "robot"], "--mail-from"),
    (["--dkim-domain", "example.com"], "together"),
])
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_bad_delivery_options(tmp_path, command, options, words):
    # serve on a new database, worker on an existing one: neither gets that far.
    if command == "serve":
        args = ["serve", "--db", "new.db", "--port", "0"]
    else:
        campaignapi.init_db(str(tmp_path / "existing.db"))
        args = ["worker", "--db", "existing.db"]
    assert words in refused(tmp_path, *args, *options)


def test_serve_with_a_bad_smtp_setting_makes_no_account_and_no_key(tmp_path):
    line = refused(tmp_path, "serve", "--db", "new.db", "--port", "0", "--smtp", "nohostport")
    assert "--smtp" in line and "nohostport" in line


@pytest.mark.parametrize("key_file, words", [
    (None, "No such file"),
    ("not a key", "cannot sign"),
])
def test_a_dkim_key_that_cannot_be_used(tmp_path, key_file, words):
    if key_file is not None:
        (tmp_path / "dkim.pem").write_text(key_file)
    line = refused(tmp_path, "serve", "--db", "new.db", "--port", "0", "--dkim-domain",
                   "example.com", "--dkim-selector", "mail", "--dkim-key", "dkim.pem")
    assert "--dkim-key dkim.pem" in line and words in line


# --- serve's own options --------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    (["--threads", "0"], "--threads"),
    (["--threads", "-3"], "--threads"),
    (["--port", "65536"], "--port"),
    (["--port", "http"], "--port"),
    (["--max-body", "0"], "--max-body"),
    (["--connection-limit", "0"], "--connection-limit"),
    (["--channel-timeout", "0"], "--channel-timeout"),
    (["--channel-timeout", "1.5"], "--channel-timeout"),
    (["--public-url", "ftp://mail.example.com"], "--public-url"),
    (["--public-url", "mail.example.com"], "--public-url"),
    (["--public-url", "https://"], "--public-url"),
    (["--public-url", "https://example.com/?a=1"], "--public-url"),
    (["--email", "not-an-address"], "--email"),
])
def test_bad_serve_options(tmp_path, options, words):
    assert words in refused(tmp_path, "serve", "--db", "new.db", *options)


@pytest.mark.parametrize("args", [
    ["--nope"],
    ["serve", "--port"],
    ["key"],
    ["key", "create"],
    ["key", "frobnicate"],
    ["worker", "extra"],
])
def test_usage_errors_are_one_line_too(tmp_path, args):
    line = refused(tmp_path, *args)
    assert "--help" in line


# --- keys -----------------------------------------------------------------------------

def test_a_key_that_would_be_dead_already_is_refused(tmp_path):
    line = refused(tmp_path, "key", "create", "--email", "a@example.com", "--expires",
                   "2020-01-01", "--db", "new.db")
    assert "in the past" in line


def test_a_key_may_expire_today(tmp_path):
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    result = run_cli("key", "create", "--email", "a@example.com", "--expires", today,
                     "--db", "k.db", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("cak_")


@pytest.mark.parametrize("args, words", [
    (["create", "--email", "nobody"], "--email"),
    (["create", "--email", "a@example.com", "--levels", "root"], "--levels"),
    (["create", "--email", "a@example.com", "--expires", "soon"], "YYYY-MM-DD"),
    (["revoke", "0"], "id"),
    (["revoke", "99999999999999999999"], "id"),
])
def test_bad_key_arguments_change_nothing(tmp_path, existing_db, args, words):
    assert words in refused(tmp_path, "key", *args, "--db", existing_db)


def test_revoking_an_unknown_key(tmp_path, existing_db):
    line = refused(tmp_path, "key", "revoke", "7", "--db", existing_db)
    assert "there is no key 7" in line
    assert [key["revoked"] for key in campaignapi.list_keys(existing_db)] == [0]


# --- what still works -------------------------------------------------------------------

def test_port_zero_serves_on_the_port_it_prints(tmp_path):
    with served("--db", "new.db", cwd=tmp_path) as server:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/campaign/all",
                                         headers={"Authorization": f"Bearer {server.secret}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


def test_every_option_says_its_default(tmp_path):
    text = " ".join(run_cli("serve", "--help", cwd=tmp_path).stdout.split())
    for option, default in [("--host", "127.0.0.1"), ("--port", "8080"),
                            ("--db", "campaignapi.db"), ("--threads", "8"),
                            ("--connections", "1"), ("--rate", "no limit"),
                            ("--max-body", "67108864"), ("--email", "admin@example.com"),
                            ("--connection-limit", "500"), ("--channel-timeout", "30"),
                            ("--smtp", "none"), ("--public-url", "http://HOST:PORT")]:
        # "--port PORT TCP port; ... (default: 8080)" in argparse's help
        pattern = rf" {re.escape(option)} [A-Z:]+ [^()]*\(default: {re.escape(default)}\b"
        assert re.search(pattern, text), option
    worker = " ".join(run_cli("worker", "--help", cwd=tmp_path).stdout.split())
    assert "it must exist (default: campaignapi.db)" in worker
