"""The README cannot drift from the product: its curl walk-through (the ``sh``
blocks between ``<!-- walkthrough`` and ``<!-- /walkthrough -->``) runs as
written, in order, in one bash, in a fresh directory holding only the module
and its schema: a real ``serve``, a real aiosmtpd sink (the README's own
command), a delivered email and an unsubscribe.  Only the two port numbers are
replaced by free ones.  It runs again in the same folder, and stops at once,
saying why, when another server has its port.  The embedding snippet is run
twice: one key."""

import email
import email.policy
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

from clihelpers import ROOT
from smtp_sink import free_port

README = os.path.join(ROOT, "README.md")
API_PORT, SMTP_PORT = "8080", "8025"


def readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def between(text, start, end):
    """The text from the line holding ``start`` up to ``end``."""
    begin = text.index(start)
    return text[begin:text.index(end, begin)]


def fenced(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)


def walkthrough_blocks():
    return fenced(between(readme(), "<!-- walkthrough", "<!-- /walkthrough -->"), "sh")


def test_the_walkthrough_is_found_and_uses_the_first_key():
    blocks = walkthrough_blocks()
    script = "\n".join(blocks)
    assert len(blocks) >= 8
    assert f"--port {API_PORT}" in script and f"127.0.0.1:{SMTP_PORT}" in script
    # The key the first start printed, never a second account or key.
    assert "key create" not in script and "grep '^cak_' serve.txt" in script
    # Every wait is bounded: each until loop counts its tries down, and says
    # what it gave up on.
    loops = re.findall(r"\buntil (.*?)\bdo\b", script, re.S)
    assert len(loops) >= 2
    for loop in loops:
        assert "$((tries -= 1))" in loop, loop


def run_walkthrough(directory, blocks, timeout=90, api_port=None):
    """Run the blocks in one bash (``set -e``), a marker after each; the
    process group (bash and what it started in the background) is stopped at
    the end, also when a block fails.  Answers (returncode, output).

    :param api_port: the port that replaces 8080 (default: a free one).
    """
    api_port, smtp_port = str(api_port or free_port()), str(free_port())
    driver = ["set -e"]
    for number, block in enumerate(blocks, 1):
        block = block.replace(API_PORT, api_port).replace(SMTP_PORT, smtp_port)
        (directory / f"block{number}.sh").write_text(block)
        driver += [f"source ./block{number}.sh", f"printf '\\n@@ block {number} done\\n'"]
    (directory / "walkthrough.sh").write_text("\n".join(driver) + "\n")
    # "python" in the README is this interpreter.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"}
    # The output goes to a file, not a pipe: what a failed block left running
    # in the background (the sink) would hold a pipe open until the timeout.
    with open(directory / "walkthrough.out", "w+") as out:
        process = subprocess.Popen(["bash", "walkthrough.sh"], cwd=directory, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=timeout)
            timed_out = ""
        except subprocess.TimeoutExpired:
            timed_out = f"\n(timed out after {timeout} s)"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=10)
        out.seek(0)
        return process.returncode, out.read() + timed_out


def copy_module(directory):
    for name in ("campaignapi.py", "schema.sql"):
        shutil.copy(os.path.join(ROOT, name), directory / name)


def test_the_walkthrough_delivers_an_email_and_unsubscribes(tmp_path):
    copy_module(tmp_path)
    check_walkthrough(tmp_path)


def test_the_walkthrough_runs_again_in_the_same_folder(tmp_path):
    # A newcomer runs it twice: the second run found demo.db, printed no key,
    # and went on without one.
    copy_module(tmp_path)
    for _ in range(2):
        check_walkthrough(tmp_path)


def test_the_walkthrough_stops_when_the_set_up_server_still_has_the_port(tmp_path):
    # The server of "Set up" (python campaignapi.py) is still running, on the
    # port the walk-through uses (8080, here replaced by a free one for both).
    copy_module(tmp_path)
    port = free_port()
    with open(tmp_path / "setup.log", "w") as log:
        setup = subprocess.Popen([sys.executable, "campaignapi.py", "serve", "--port", str(port),
                                  "--db", "setup.db"], cwd=tmp_path, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while b"serving" not in (tmp_path / "setup.log").read_bytes():
            assert setup.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "setup.log").read_text()
            time.sleep(0.1)
        started = time.monotonic()
        returncode, output = run_walkthrough(tmp_path, walkthrough_blocks(), api_port=port)
        assert time.monotonic() - started < 30, output
        # It stopped at the server's block, saying why, before any request
        # reached the other server.
        assert returncode != 0, output
        assert re.findall(r"^@@ block (\d+) done$", output, re.M) == ["1"], output
        assert f"Port {port} is in use (the server of Set up?): stop it" in output, output
        assert setup.poll() is None
        log = (tmp_path / "setup.log").read_text()
        assert not re.search(r"\b(GET|PUT|POST|DELETE) /", log), log
        assert not (tmp_path / "demo.db").exists()
    finally:
        setup.terminate()
        setup.wait(timeout=10)


def check_walkthrough(tmp_path):
    """Run the walk-through in ``tmp_path`` and check what it did."""
    blocks = walkthrough_blocks()
    returncode, output = run_walkthrough(tmp_path, blocks)
    done = re.findall(r"^@@ block (\d+) done$", output, re.M)
    log = (tmp_path / "serve.log").read_text() if (tmp_path / "serve.log").exists() else ""
    assert returncode == 0 and len(done) == len(blocks), (
        f"block {len(done) + 1} failed:\n{output}\n--- serve.log:\n{log}")

    # The emails as the sink received them (aiosmtpd's Debugging handler).
    mail = (tmp_path / "mail.txt").read_text()
    emails = [email.message_from_string(part.split("\n", 1)[1], policy=email.policy.default)
              for part in mail.split("---------- MESSAGE FOLLOWS ----------")[1:]]
    by_recipient = {message["To"]: message for message in emails}
    assert set(by_recipient) == {"you@example.com", "ann@example.org", "bob@example.org"}
    ann = by_recipient["ann@example.org"]
    assert ann["Subject"] == "Hello Ann" and ann["From"] == "The Shop <news@example.com>"
    assert "Hi Ann, spring is here." in ann.get_body(("plain",)).get_content()
    assert ann["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"

    # Ann clicked her link; Bob did not.
    conn = sqlite3.connect(tmp_path / "demo.db")
    statuses = dict(conn.execute("SELECT email, status FROM recipient"))
    conn.close()
    assert statuses == {"ann@example.org": "unsubscribed", "bob@example.org": "active"}
    # One account, one key: the one the first start printed.
    conn = sqlite3.connect(tmp_path / "demo.db")
    assert conn.execute("SELECT count(*) FROM apikey").fetchone()[0] == 1
    conn.close()
    assert '"email":"ann@example.org"' in output


def test_the_embedding_snippet_issues_one_key_however_often_it_starts(tmp_path):
    snippet, = fenced(between(readme(), "<!-- embedding", "## Decisions"), "python")[:1]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
    printed = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        printed.append(result.stdout)
    assert printed[0].startswith("API key, shown only once: cak_") and printed[1] == ""
    import campaignapi

    keys = campaignapi.list_keys(str(tmp_path / "campaigns.db"))
    assert [key["email"] for key in keys] == ["owner@example.com"]
