"""Import benchmark: N rows through the API against a bare sqlite3 executemany.

    python bench/bench_import.py [ROWS] [csv|base64]

Each measurement runs in its own process so that its peak RSS is its own.
Targets: the API import at >= 0.5x the speed of the bare executemany of the
same rows, and peak RSS <= 4x the upload (the request body).
"""

import base64
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import campaignapi  # noqa: E402


def csv_text(rows):
    return "email,first name,age,city\n" + "".join(
        f"user{i}@example.com,Name {i},{i % 90},City {i % 500}\n" for i in range(rows))


def peak_mb():
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not carried over
    from the parent through fork and exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_body(rows, kind, path):
    """The request body of the import, built once, in the parent process."""
    text = csv_text(rows)
    data = text if kind == "csv" else base64.b64encode(text.encode()).decode()
    del text
    with open(path, "wb") as file:
        file.write(json.dumps({"name": "bench", "originalfile": "bench.csv",
                               "__uploadtype__": kind, "__uploaddata__": data}).encode())


def run_api(body_path, folder):
    db = os.path.join(folder, "api.db")
    secret = campaignapi.create_key(db, "bench@example.com")
    app = campaignapi.create_app(db)
    conn = campaignapi.connect(db)
    conn.execute("INSERT INTO datasource (owner, name) VALUES (1, 'bench')")
    conn.execute("INSERT INTO field (datasource, name, type) VALUES (1, 'email', 'email')")
    conn.close()
    base = peak_mb()
    size = os.path.getsize(body_path)
    # A file, as waitress hands over a large body (it spools it to disk).
    body = open(body_path, "rb")
    environ = {"REQUEST_METHOD": "PUT", "PATH_INFO": "/v1/datasource/1/import/0",
               "SERVER_NAME": "localhost", "SERVER_PORT": "80", "wsgi.url_scheme": "http",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(size),
               "HTTP_AUTHORIZATION": f"Bearer {secret}", "wsgi.input": body,
               "wsgi.errors": sys.stderr, "QUERY_STRING": ""}
    statuses = []
    started = time.perf_counter()
    answer = b"".join(app(environ, lambda status, headers, exc=None: statuses.append(status)))
    seconds = time.perf_counter() - started
    body.close()
    assert statuses[0].startswith("200"), answer
    return {"seconds": seconds, "upload_mb": size / 2**20, "peak_mb": peak_mb(),
            "baseline_mb": base}


def run_bare(rows, folder):
    db = os.path.join(folder, "bare.db")
    campaignapi.init_db(db)
    conn = campaignapi.connect(db)
    conn.execute("INSERT INTO account (email) VALUES ('b@example.com')")
    conn.execute("INSERT INTO datasource (owner, name) VALUES (1, 'bench')")
    now = campaignapi._now()
    params = [(1, f"user{i}@example.com",
               json.dumps({"2": f"Name {i}", "3": str(i % 90), "4": f"City {i % 500}"},
                          separators=(",", ":")), now, now) for i in range(rows)]
    started = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany("INSERT INTO recipient (datasource, email, data, created, updated) "
                     "VALUES (?, ?, ?, ?, ?)", params)
    conn.execute("COMMIT")
    return {"seconds": time.perf_counter() - started}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, what, arg = sys.argv
        with tempfile.TemporaryDirectory() as folder:
            result = run_bare(int(arg), folder) if what == "bare" else run_api(arg, folder)
        print(json.dumps(result))
        return
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    kind = sys.argv[2] if len(sys.argv) > 2 else "base64"

    def child(what, arg):
        out = subprocess.run([sys.executable, __file__, "--child", what, str(arg)],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])

    with tempfile.TemporaryDirectory() as folder:
        body = os.path.join(folder, "body.json")
        write_body(rows, kind, body)
        bare, api = child("bare", rows), child("api", body)
    print(f"{rows} rows, upload type {kind}, upload {api['upload_mb']:.1f} MB")
    print(f"bare executemany: {bare['seconds']:.2f}s ({rows / bare['seconds']:,.0f} rows/s)")
    print(f"API import:       {api['seconds']:.2f}s ({rows / api['seconds']:,.0f} rows/s), "
          f"speed {bare['seconds'] / api['seconds']:.2f}x of bare")
    print(f"peak RSS {api['peak_mb']:.0f} MB ({api['peak_mb'] / api['upload_mb']:.1f}x upload); "
          f"{api['baseline_mb']:.0f} MB before the request (the interpreter)")


if __name__ == "__main__":
    main()
