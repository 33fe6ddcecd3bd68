"""Logging when embedded: importing campaignapi configures nothing, and one call,
``campaignapi.log_to_stderr()``, gives the request log under any WSGI server.
Each test runs in a fresh interpreter, as an application would (pytest's own
log capture would otherwise stand in for the host's configuration)."""

import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

from clihelpers import ROOT
from smtp_sink import free_port

ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
REQUEST_LINE = re.compile(r"campaignapi INFO ([0-9a-f]{32}) GET /v1/openapi.json 200 [\d.]+ms$")


def run_python(code, cwd):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def test_import_configures_nothing_and_the_call_gives_one_line_per_request(tmp_path):
    result = run_python("""
        import logging, sys
        import campaignapi, webtest
        logger = logging.getLogger("campaignapi")
        assert not logger.handlers and logger.level == logging.NOTSET
        assert not logging.getLogger().handlers
        client = webtest.TestApp(campaignapi.create_app("embedded.db"))
        client.get("/v1/openapi.json")
        print("-- before the call", file=sys.stderr, flush=True)
        campaignapi.log_to_stderr()
        campaignapi.log_to_stderr()     # a second call adds no second handler
        print(client.get("/v1/openapi.json").headers["X-Response-Id"])
        campaignapi.log_to_stderr(logging.WARNING)
        client.get("/v1/openapi.json")
        assert not logging.getLogger().handlers   # the root logger is the host's
        """, tmp_path)
    before, _, after = result.stderr.partition("-- before the call\n")
    assert before == ""
    lines = after.splitlines()
    assert len(lines) == 1, result.stderr
    match = REQUEST_LINE.search(lines[0])
    assert match and match[1] == result.stdout.strip()


def serve_module(tmp_path, module_text):
    """Run ``waitress-serve wsgiapp:app`` (the module given) and request the
    OpenAPI document once: (its X-Response-Id, what the process wrote to stderr)."""
    (tmp_path / "wsgiapp.py").write_text(textwrap.dedent(module_text))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "waitress", "--host=127.0.0.1",
                                f"--port={port}", "wsgiapp:app"], cwd=tmp_path, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "no server"
            try:
                url = f"http://127.0.0.1:{port}/v1/openapi.json"
                with urllib.request.urlopen(url, timeout=5) as response:
                    response_id = response.headers["X-Response-Id"]
                    break
            except urllib.error.URLError:
                time.sleep(0.05)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=20)
    return response_id, stderr


def test_under_waitress_serve_the_call_gives_the_request_log(tmp_path):
    response_id, stderr = serve_module(tmp_path, """
        import campaignapi
        app = campaignapi.create_app("embedded.db")
        campaignapi.log_to_stderr()
        """)
    assert [m[1] for m in map(REQUEST_LINE.search, stderr.splitlines()) if m] == [response_id]


def test_under_waitress_serve_without_the_call_there_is_no_request_log(tmp_path):
    response_id, stderr = serve_module(tmp_path, """
        import campaignapi
        app = campaignapi.create_app("embedded.db")
        """)
    assert response_id and response_id not in stderr
    assert not any(map(REQUEST_LINE.search, stderr.splitlines()))
