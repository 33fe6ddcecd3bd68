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
import contextlib
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
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
        self.numbers = itertools.count(1)

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

    @contextlib.contextmanager
    def database(self, template="template0"):
        """``with cluster.database() as url:`` a new, empty database, dropped after.

        Copied from template0 by file copy (12 ms on an idle machine, against
        25 ms for the default WAL-logged copy)."""
        import psycopg  # only the PostgreSQL runs need it

        name = f"db_{os.getpid()}_{next(self.numbers)}"
        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name} TEMPLATE {template} STRATEGY FILE_COPY")
            try:
                yield self.url(name)
            finally:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

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
    """Databases for one test each, copies of ``template``, used again.

    Copying a database costs 15-300 ms (more when the disk is busy), as much
    as a test.  So ``give_back(name)`` empties it instead: the other
    connections to it are ended, every row deleted, every sequence started
    again, which takes a few milliseconds and leaves it as the copy was.  One
    whose tables or schema version a test changed is dropped, never reused.
    """

    def __init__(self, cluster, template):
        import psycopg  # only the PostgreSQL runs need it

        self.cluster, self.template = cluster, template
        self.admin = psycopg.connect(cluster.url(), autocommit=True)
        self.free, self.numbers = [], itertools.count(1)
        with psycopg.connect(cluster.url(template), autocommit=True) as conn:
            self.shape = self._shape(conn)
            tables = [row[0] for row in conn.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace "
                "AND relkind = 'r' AND relname != 'campaignapi_schema' ORDER BY oid DESC")]
            sequences = [row[0] for row in conn.execute(
                "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'")]
        # Children before parents: schema.sql makes the parents first.
        self.empty = ("BEGIN;" + "".join(f"DELETE FROM {table};" for table in tables)
                      + "".join(f"SELECT setval('{sequence}', 1, false);" for sequence in sequences)
                      + "COMMIT;")

    @staticmethod
    def _shape(conn):
        """Every column of every table and index, and the schema version."""
        return conn.execute(
            "SELECT string_agg(c.relname || '.' || a.attname || ':' || a.atttypid::text, ','"
            "                  ORDER BY c.oid, a.attnum), "
            "       (SELECT string_agg(version::text, ',') FROM campaignapi_schema) "
            "FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid "
            "WHERE c.relnamespace = 'public'::regnamespace AND a.attnum > 0 "
            "AND NOT a.attisdropped").fetchone()

    def take(self):
        """The name of a database with the template's schema and no rows."""
        if self.free:
            return self.free.pop()
        name = f"test_{os.getpid()}_{next(self.numbers)}"
        self.admin.execute(f"CREATE DATABASE {name} TEMPLATE {self.template}")
        return name

    def give_back(self, name):
        """Empty ``name`` for the next test, or drop it when it cannot be reused."""
        import psycopg

        self.admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = %s AND pid != pg_backend_pid()", (name,))
        try:
            with psycopg.connect(self.cluster.url(name), autocommit=True) as conn:
                if self._shape(conn) != self.shape:
                    raise ValueError("the test changed the schema")
                conn.execute(self.empty)
        except (psycopg.Error, ValueError):
            self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            return
        self.free.append(name)

    def close(self):
        """Drop the free databases."""
        for name in self.free:
            self.admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.free = []
        self.admin.close()
