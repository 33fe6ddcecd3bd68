"""The package installs anywhere: sdist and wheel carry the schema, the
console script works, and an app can be built from any directory.

Slow (a fresh venv, bottle and waitress from PyPI): CAMPAIGNAPI_QUICK=1 skips it.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

import campaignapi

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(os.environ.get("CAMPAIGNAPI_QUICK")),
                       reason="CAMPAIGNAPI_QUICK is set: packaging test skipped"),
]

# Run from a directory without campaignapi.py: the import must find the installed one.
PROBE = textwrap.dedent("""
    import io, json, os, sys, wsgiref.util
    import campaignapi
    assert "site-packages" in campaignapi.__file__, campaignapi.__file__
    db = os.path.join(os.getcwd(), "probe.db")
    app = campaignapi.create_app(db)
    secret = campaignapi.create_key(db, "owner@example.com")
    body = json.dumps({"name": "From the wheel", "accountprofile": 1}).encode()
    environ = {"REQUEST_METHOD": "PUT", "PATH_INFO": "/v1/campaign/0",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body), "HTTP_AUTHORIZATION": "Bearer " + secret}
    wsgiref.util.setup_testing_defaults(environ)
    status = []
    answer = b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    print(status[0], answer.decode())
""")


def run(*command, cwd, env):
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtual environment (no system site-packages) with hatchling."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(home / "env")], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    bin_dir = home / "env" / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    python = str(bin_dir / "python")
    run(python, "-m", "pip", "install", "-q", "hatchling>=1.18", cwd=home, env=env)
    return home, python, env


def build(python, env, source, kind, into):
    """Build a wheel or an sdist through hatchling's PEP 517 hooks."""
    run(python, "-c", f"import hatchling.build as b; print(b.build_{kind}({str(into)!r}))",
        cwd=source, env=env)
    suffix = ".whl" if kind == "wheel" else ".tar.gz"
    (built,) = [p for p in into.iterdir() if p.name.endswith(suffix)]
    return built


def test_sdist_and_wheel_install_and_run_from_anywhere(venv):
    home, python, env = venv
    source = home / "checkout"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.db*", ".pytest_cache", ".hypothesis", "dist", "build"))

    # The sdist holds what a wheel needs; the wheel is built from the sdist.
    sdist = build(python, env, source, "sdist", home / "sdist")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        archive.extractall(home / "unpacked", filter="data")
    assert {"campaignapi.py", "schema.sql", "README.md", "pyproject.toml"} <= names
    assert any(name.startswith("tests/") for name in names)
    (unpacked,) = (home / "unpacked").iterdir()
    wheel = build(python, env, unpacked, "wheel", home / "wheel")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "campaignapi = campaignapi:main" in archive.read(entry_points).decode()
    assert {"campaignapi.py", "campaignapi.schema.sql"} <= names
    assert not any(name.startswith("tests/") for name in names)

    # Installed into the fresh venv (bottle and waitress come from PyPI).
    run(python, "-m", "pip", "install", "-q", str(wheel), cwd=home, env=env)
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    status, _, answer = run(python, "-c", PROBE, cwd=elsewhere, env=env).partition(" {")
    assert status.startswith("200"), answer
    assert campaignapi.json.loads("{" + answer)["data"] == {"id": "1"}

    # The console script is the module's command line.
    script = str(Path(python).parent / "campaignapi")
    assert run(script, "--version", cwd=elsewhere, env=env).strip() == campaignapi.__version__
    output = run(script, "key", "create", "--email", "cli@example.com", "--levels", "read",
                 "--db", "cli.db", cwd=elsewhere, env=env)
    assert output.strip().splitlines()[-1].startswith("cak_")
    assert "cli@example.com\tread" in run(script, "key", "list", "--db", "cli.db",
                                          cwd=elsewhere, env=env)

    # `pip install .` from a checkout gives the same.
    run(python, "-m", "pip", "install", "-q", "--no-build-isolation", "--force-reinstall",
        "--no-deps", str(source), cwd=home, env=env)
    (elsewhere / "probe.db").unlink()
    assert run(python, "-c", PROBE, cwd=elsewhere, env=env).startswith("200")
