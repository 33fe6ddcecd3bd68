"""The command line with a postgresql:// URL as --db: refused in one line
(exit 2, the password never shown) when the server cannot be reached or the
database is not campaignapi's; a key made on it works.  Needs PostgreSQL."""

from clihelpers import run_cli
from helpers import free_port
from test_cli_failures import refused


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path):
    url = f"postgresql://shop:hunter2@127.0.0.1:{free_port()}/campaigns"
    for command in (["worker", "--smtp", "127.0.0.1:25"], ["key", "list"],
                    ["serve", "--port", "0"]):
        line = refused(tmp_path, *command, "--db", url)
        assert "cannot connect" in line and "hunter2" not in line


def test_a_database_without_the_schema_is_refused_where_it_must_exist(tmp_path, pg_db):
    line = refused(tmp_path, "worker", "--smtp", "127.0.0.1:25", "--db", pg_db)
    assert "no campaignapi database" in line


def test_another_applications_database_is_left_alone(tmp_path, pg_db):
    import psycopg

    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
    assert "another application" in refused(tmp_path, "serve", "--port", "0", "--db", pg_db)


def test_key_create_makes_the_schema_and_a_key(tmp_path, pg_db):
    created = run_cli("key", "create", "--email", "a@example.com", "--db", pg_db, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip().splitlines()[-1].startswith("cak_")
    listed = run_cli("key", "list", "--db", pg_db, cwd=tmp_path)
    assert listed.returncode == 0 and "a@example.com" in listed.stdout
