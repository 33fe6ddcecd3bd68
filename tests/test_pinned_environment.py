"""The pinned test environment: pyproject.toml keeps ranges with tested upper
bounds, tests/constraints.txt (made by uv) pins every package at one version
inside them, and .ci/run installs exactly that.  A fresh resolve once brought
a pytest that broke schemathesis on every new machine; these keep the lock and
the ranges from drifting apart."""

import os
import pathlib
import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = ROOT / "tests" / "constraints.txt"


def _locked():
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"not an exact pin in {LOCK.name}: {line!r}"
            pins[canonicalize_name(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def _requirements(*groups):
    found = [Requirement(text) for text in PROJECT["dependencies"]]
    extras = PROJECT["optional-dependencies"]
    for group in groups or extras:
        found += [Requirement(text) for text in extras[group]]
    return found


def test_every_runtime_range_has_a_tested_upper_bound():
    for requirement in _requirements("dkim", "providers", "postgres"):
        uppers = [spec for spec in requirement.specifier if spec.operator in ("<", "<=", "~=", "==")]
        assert uppers, f"{requirement} has no upper bound"


def test_the_lock_pins_every_direct_dependency_inside_its_range():
    pins = _locked()
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in {LOCK.name}: refresh the lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"{LOCK.name} pins {name}=={pins[name]}, outside {requirement}: refresh the lock"


def test_ci_installs_with_the_lock():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"pip install .*-c tests/constraints\.txt -e '\.\[test\]'", script)
    assert "uv pip compile pyproject.toml" in LOCK.read_text().splitlines()[1]


@pytest.mark.skipif(not os.environ.get("CI"), reason="only the environment .ci/run made is pinned")
def test_the_running_environment_is_the_locked_one():
    pins = _locked()
    for requirement in _requirements("test"):
        name = canonicalize_name(requirement.name)
        assert metadata.version(name) == pins[name], (name, metadata.version(name), pins[name])
