"""The one request id (cluster.http.ids) and its log tag (kvruntime.request_log), without a
cluster; tests/test_e2e_cluster.py follows one request through every process' log."""
import logging
import re

from cluster.http.ids import request_id, well_formed
from kvruntime import request_log


def test_the_clients_id_is_kept_when_well_formed_else_one_is_drawn():
    assert request_id({"x-request-id": "abc-1.2:3_Z"}) == ("abc-1.2:3_Z", True)     # no proxy here: set it
    for bad in ("", "has space", "x" * 129, "semi;colon", "ünïcode"):
        assert not well_formed(bad)
        rid, set_header = request_id({"x-request-id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", rid) and set_header
    assert well_formed("x" * 128)
    a, b = request_id({})[0], request_id({})[0]
    assert a != b and re.fullmatch(r"[0-9a-f]{32}", a)


def test_every_record_made_inside_a_request_carries_its_id(caplog):
    request_log.install()
    log = logging.getLogger("cluster.control.test_ids")
    with caplog.at_level(logging.INFO, logger="cluster.control.test_ids"):
        log.info("outside %d", 1)
        with request_log.bound("rid-7"):
            log.info("inside %s", "a plan")
            log.info("already names request_id=rid-7")
        log.info("after")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["outside 1", "inside a plan request_id=rid-7", "already names request_id=rid-7", "after"]
    assert [r.kvnotes_request_id for r in caplog.records] == ["-", "rid-7", "rid-7", "-"]


def test_a_library_passing_its_own_request_id_in_extra_still_logs(caplog):
    """Ray Serve's access log line (``serve._private.replica``) passes ``extra={"request_id": ...}``:
    the factory must not have set that attribute already (``logging`` raises KeyError, which failed
    every request in the replica after its response)."""
    request_log.install()
    log = logging.getLogger("ray.serve.test_access_log")
    with caplog.at_level(logging.INFO, logger="ray.serve.test_access_log"):
        with request_log.bound("rid-8"):
            log.info("POST /v1/completions 200 3.0ms", extra={"request_id": "serve-id", "route": "/"})
        log.info("GET /health 200 1.0ms", extra={"request_id": "serve-id-2"})
    assert [r.request_id for r in caplog.records] == ["serve-id", "serve-id-2"]
    assert [r.kvnotes_request_id for r in caplog.records] == ["rid-8", "-"]
