"""The pure helpers of bench/bench.py: wrk's output, percentiles and
latencies from due times, growth ratios, the JSON line.  Fast, and wrk need
not be installed: the samples are wrk 4 output captured on this machine."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import bench  # noqa: E402

WRK_OK = """Running 2s test @ http://127.0.0.1:18931/ok
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.24ms    3.07ms  36.94ms   91.11%
    Req/Sec     5.62k     0.86k    6.92k    70.00%
  Latency Distribution
     50%    2.27ms
     75%    3.87ms
     90%    6.11ms
     99%   18.00ms
  11179 requests in 2.01s, 1.44MB read
Requests/sec:   5570.08
Transfer/sec:    734.40KB
"""

WRK_NON_2XX = """Running 2s test @ http://127.0.0.1:18931/nf
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.57ms    2.10ms  18.48ms   72.01%
    Req/Sec     4.62k   493.87     5.38k    65.00%
  Latency Distribution
     50%    2.82ms
     75%    4.71ms
     90%    6.61ms
     99%    9.50ms
  9185 requests in 2.00s, 7.44MB read
  Non-2xx or 3xx responses: 9185
Requests/sec:   4587.64
Transfer/sec:      3.71MB
"""

WRK_SOCKET_ERRORS = """Running 2s test @ http://127.0.0.1:18932/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   460.44us    1.09ms  10.50ms   88.33%
    Req/Sec     3.01k     0.98k    5.96k    80.95%
  Latency Distribution
     50%   69.00us
     75%  114.00us
     90%    1.86ms
     99%    5.31ms
  6290 requests in 2.11s, 245.70KB read
  Socket errors: connect 0, read 18870, write 0, timeout 0
Requests/sec:   2983.38
Transfer/sec:    116.54KB
"""

WRK_REFUSED = """unable to connect to 127.0.0.1:18939 Connection refused"""


def test_parse_wrk_reads_rate_latencies_and_no_errors():
    assert bench.parse_wrk(WRK_OK) == {
        "rps": 5570, "requests": 11179, "p50_ms": 2.27, "p99_ms": 18.0,
        "non_2xx": 0, "socket_errors": 0, "errors": 0}


def test_parse_wrk_counts_non_2xx_answers_as_errors():
    figures = bench.parse_wrk(WRK_NON_2XX)
    assert (figures["rps"], figures["p50_ms"], figures["p99_ms"]) == (4588, 2.82, 9.5)
    assert figures["non_2xx"] == figures["errors"] == 9185


def test_parse_wrk_counts_socket_errors_and_reads_microseconds():
    figures = bench.parse_wrk(WRK_SOCKET_ERRORS)
    assert figures["socket_errors"] == figures["errors"] == 18870
    assert figures["p50_ms"] == 0.07 and figures["p99_ms"] == 5.31


def test_parse_wrk_without_figures_says_what_wrk_said():
    with pytest.raises(RuntimeError, match="Connection refused"):
        bench.parse_wrk(WRK_REFUSED)


@pytest.mark.parametrize("text, ms", [("850.00us", 0.85), ("3.85ms", 3.85), ("1.02s", 1020.0),
                                      ("2.00m", 120000.0)])
def test_wrk_durations_in_every_unit(text, ms):
    assert bench._ms(text) == pytest.approx(ms)
