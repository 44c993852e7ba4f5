"""The errors of a server as its runner reads them (areal_cli.request_errors): an engine's
access log, and when a run of errors is a client refused for good."""

from __future__ import annotations

from areal_cli import request_errors


def test_an_engines_errors_are_read_from_its_access_log(tmp_path):
    # SGLang and vLLM print uvicorn's access line for each answer; the runner reads them as
    # they come (the engine's own log file, which it writes), probes and reads left out.
    log = tmp_path / "server-0.log"
    log.write_text("INFO:     Started server process [1]\n")
    seen = request_errors.AccessLog(log)
    assert seen.read()["errors"] == 0
    lines = [
        'INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 503 Service Unavailable',
        'INFO:     127.0.0.1:5 - "POST /generate HTTP/1.1" 200 OK',
        *['INFO:     127.0.0.1:5 - "POST /init_weights_update_group HTTP/1.1" 400 Bad Request'] * 6,
        'INFO:     127.0.0.1:5 - "GET /server_info?x=1 HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:5 - "POST /generate HTTP/1.1" 40',  # written in two pieces
    ]
    with log.open("a") as f:
        f.write("\n".join(lines))
    got = seen.read()
    assert (got["errors"], got["answered"], got["streak"], got["total"]) == (6, 1, 6, 6)
    assert got["last"]["route"] == "POST /init_weights_update_group"
    assert got["last"]["status"] == 400 and got["source"] == "access log"
    with log.open("a") as f:
        f.write("0 Bad Request\n")
    got = seen.read()
    assert (got["errors"], got["streak"], got["last"]["route"]) == (7, 7, "POST /generate")
    assert request_errors.marker(got) == "errors 7/min"


def test_a_refusal_is_a_run_of_errors_that_lasts():
    base = {"window_s": 60.0, "errors": 6, "answered": 0, "total": 6, "last": None}
    assert not request_errors.refusing(None)
    assert not request_errors.refusing({**base, "streak": 4, "streak_s": 30.0})  # too few
    assert not request_errors.refusing({**base, "streak": 6, "streak_s": 2.0})  # too short
    assert request_errors.refusing({**base, "streak": 6, "streak_s": 12.0})
    last = {"route": "POST /generate", "status": 400, "message": "no image_data"}
    line = request_errors.describe("h:1", {**base, "answered": 2, "streak": 6, "streak_s": 12.0,
                                           "last": last})  # fmt: skip
    assert line.startswith("server h:1 answered 6 of 8 requests of the last 60s with errors")
    assert line.endswith("last: POST /generate 400: no image_data")
    assert request_errors.marker({**base, "errors": 0}) == ""
