"""A throwaway PostgreSQL cluster for the tests, from Debian's packages.

``PgCluster().start()`` runs initdb into a temporary directory and starts the
server with pg_ctl on 127.0.0.1 and a free port (its unix socket inside that
directory); ``stop()`` stops it (``-m fast``, then ``-m immediate``) and removes
the directory.  Tuned for tests, not for data: fsync, synchronous_commit and
full_page_writes are off.  Trust authentication, on loopback only.

initdb refuses to run as root, so as root the cluster belongs to the
``postgres`` user (``runuser -u postgres --``), the owner of Debian's package.

The cluster runs with the C locale: lower() and citext then fold ASCII only,
like SQLite's NOCASE (see campaignapi's engine banner).
"""

import atexit
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

STOP_TIMEOUT = 15


def pg_bindir():
    """The newest of Debian's /usr/lib/postgresql/*/bin, or None when not installed."""
    found = [path for path in glob.glob("/usr/lib/postgresql/*/bin")
             if os.path.exists(os.path.join(path, "pg_ctl"))]
    found.sort(key=lambda path: int(path.split("/")[-2]) if path.split("/")[-2].isdigit() else 0)
    return found[-1] if found else None


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgCluster:
    """One PostgreSQL server in a temporary directory; ``url(dbname)`` reaches it."""

    def __init__(self, bindir=None):
        self.bindir = bindir or pg_bindir()
        if not self.bindir:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.root = self.port = None
        self.running = False
        self.timings = {}

    @property
    def data(self):
        return os.path.join(self.root, "data")

    def _run(self, *argv, check=True, timeout=60):
        """Run a PostgreSQL program as the cluster's owner."""
        argv = [os.path.join(self.bindir, argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        return subprocess.run(argv, check=check, timeout=timeout, capture_output=True, text=True)

    def start(self):
        """initdb and start; returns self.  Registers stop() with atexit."""
        started = time.monotonic()
        self.root = tempfile.mkdtemp(prefix="campaignapi-pg-")
        atexit.register(self.stop)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        try:
            self._run("initdb", "-D", self.data, "-U", "postgres", "-E", "UTF8", "--no-locale",
                      "--no-sync", "--auth-local=trust", "--auth-host=trust")
            with open(os.path.join(self.data, "pg_hba.conf"), "w") as hba:
                hba.write("local all all trust\n"
                          "host all all 127.0.0.1/32 trust\n"
                          "host all all ::1/128 trust\n")
            self.timings["initdb"] = time.monotonic() - started
            for attempt in range(3):  # another process may take the free port first
                self.port = _free_port()
                options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                           "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                           "-c max_connections=200 -c shared_buffers=32MB")
                result = self._run("pg_ctl", "start", "-D", self.data, "-w", "-t", "30",
                                   "-l", os.path.join(self.root, "server.log"), "-o", options,
                                   check=False)
                if result.returncode == 0:
                    self.running = True
                    break
            else:
                raise RuntimeError(f"pg_ctl start failed: {result.stderr}{self.log()}")
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - started
        return self

    def log(self):
        """The server's log so far (for failure messages)."""
        with open(os.path.join(self.root, "server.log"), errors="replace") as file:
            return file.read()

    def url(self, dbname="postgres"):
        """A ``postgresql://`` URL of ``dbname`` on this cluster."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def stop(self):
        """Stop the server (fast, then immediate) and remove the directory; idempotent."""
        if self.root is None:
            return
        if self.running or os.path.exists(os.path.join(self.data, "postmaster.pid")):
            for mode in ("fast", "immediate"):
                try:
                    if self._run("pg_ctl", "stop", "-D", self.data, "-m", mode, "-w",
                                 "-t", str(STOP_TIMEOUT), check=False,
                                 timeout=STOP_TIMEOUT + 5).returncode == 0:
                        break
                except subprocess.TimeoutExpired:
                    continue
            self.running = False
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None


class DatabasePool:
    """New databases made ahead by a background thread, copies of ``template``.

    ``take()`` hands out a database's name (waiting while none is ready),
    ``give_back(name)`` has it dropped, in the background too: creating one
    costs 15-300 ms (more when the disk is busy), which a test need not wait
    for while the previous test runs.
    """

    def __init__(self, cluster, template, size=3):
        import psycopg  # only the PostgreSQL runs need it

        self.cluster, self.template, self.size = cluster, template, size
        self.admin = psycopg.connect(cluster.url(), autocommit=True)
        self.ready, self.dropping = [], []
        self.numbers = itertools.count(1)
        self.lock = threading.Condition()
        self.closed = False
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            with self.lock:
                while not self.closed and not self.dropping and len(self.ready) >= self.size:
                    self.lock.wait(1.0)
                if self.closed:
                    return
                drop = self.dropping.pop() if self.dropping else None
            try:
                if drop:
                    self.admin.execute(f"DROP DATABASE IF EXISTS {drop} WITH (FORCE)")
                    continue
                name = f"test_{os.getpid()}_{next(self.numbers)}"
                self.admin.execute(f"CREATE DATABASE {name} TEMPLATE {self.template}")
            except Exception as error:  # reported by take(), not lost in a thread
                with self.lock:
                    self.error = error
                    self.lock.notify_all()
                return
            with self.lock:
                self.ready.append(name)
                self.lock.notify_all()

    def take(self, timeout=60):
        """The name of a new database for one test."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not self.ready:
                if self.error:
                    raise RuntimeError(f"making a test database failed: {self.error}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no test database was ready within {timeout} s")
                self.lock.wait(0.5)
            self.lock.notify_all()
            return self.ready.pop(0)

    def give_back(self, name):
        """Drop ``name`` (in the background)."""
        with self.lock:
            self.dropping.append(name)
            self.lock.notify_all()

    def close(self):
        """Stop the thread and drop every database still ready or to drop."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        self.thread.join(30)
        for name in self.ready + self.dropping:
            self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.admin.close()
