"""Helpers for tests that run ``python campaignapi.py ...`` as a real process."""

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "campaignapi.py")
BANNER = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)/v1/$")


def run_cli(*args, cwd, timeout=30):
    """Run the command line to its end: the CompletedProcess (text)."""
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def snapshot(directory):
    """Every file under ``directory``: relative path -> SHA-256 of its bytes."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return files


class Served:
    """``python campaignapi.py serve --port 0 ...`` as a real process; ``port``
    is read from its start banner, ``lines`` is everything it printed."""

    def __init__(self, *args, cwd, timeout=30):
        self.lines = []
        self.process = subprocess.Popen(
            [sys.executable, SCRIPT, "serve", "--port", "0", *args], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.banner = threading.Event()
        self.port = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self.banner.wait(timeout):
            self.stop()
            raise AssertionError("serve printed no banner:\n" + "\n".join(self.lines))

    def _read(self):
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            match = BANNER.search(line)
            if match and self.port is None:
                self.port = int(match[1])
                self.banner.set()
        self.banner.set()

    @property
    def secret(self):
        return next(line for line in self.lines if line.startswith("cak_"))

    def wait_listening(self, timeout=20):
        """The banner comes just before waitress binds: wait until it accepts."""
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "\n".join(self.lines)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("serve does not accept connections")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


@contextlib.contextmanager
def served(*args, cwd):
    """``with served("--db", db, cwd=tmp_path) as server:`` ... stopped at the end."""
    if "--port" in args:
        raise ValueError("served() listens on port 0 and reads the real port")
    server = Served(*args, cwd=cwd)
    try:
        server.wait_listening()
        yield server
    finally:
        server.stop()
