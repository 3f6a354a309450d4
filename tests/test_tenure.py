"""A launched coordinator's tenure (coordinator/cluster/tenure.py): it ends once a member reports a newer
coordinator's term, and the port of the API it stopped then says where the cluster is served now."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mtpipe.coordinator.api.stepped_down import SteppedDown
from mtpipe.coordinator.cluster.tenure import Tenure, claims_at, newest
from mtpipe.node.coordinators import Claim
from mtpipe.node.server import NodeServer


def test_the_newest_claim_that_outranks_this_one() -> None:
    a1, b2, c2 = Claim(1, "node-a"), Claim(2, "node-b"), Claim(2, "node-c")
    assert newest([a1, c2, Claim()], a1) == c2 and newest([c2, b2], a1) == b2
    assert newest([a1, Claim()], a1) is None and newest([a1], b2) is None and newest([], a1) is None


def test_a_tenure_ends_when_a_member_knows_a_newer_term() -> None:
    servers = [NodeServer("127.0.0.1", 0).start() for _ in range(2)]
    try:
        addresses = [s.address for s in servers]
        servers[0].service.coordinators.see(Claim(1, "node-a"))
        assert claims_at([*addresses, "127.0.0.1:1"], None) == [Claim(1, "node-a")]  # (one says none; one is not there)
        tenure = Tenure(Claim(1, "node-a"), lambda: addresses, None, check_s=0.05).start()
        assert not tenure.over.wait(0.5) and tenure.successor is None
        servers[1].service.coordinators.see(Claim(2, "node-b"))  # (node-b was elected and loaded it)
        assert tenure.over.wait(10) and tenure.successor == Claim(2, "node-b")
        newer = Tenure(Claim(2, "node-b"), lambda: addresses, None, check_s=0.05).start()
        assert not newer.over.wait(0.5)
        newer.stop()
    finally:
        for s in servers:
            s.stop(0)


@pytest.mark.parametrize("https", [False, True], ids=["http", "https"])
def test_a_stepped_down_api_names_the_coordinator_now(https: bool, tmp_path: Path) -> None:
    """Over HTTPS where the API served it (--ssl-certfile / --ssl-keyfile)."""
    import ssl

    from mtpipe.coordinator.api.tls import api_tls

    tls, context = None, None
    if https:
        from test_api_front import _self_signed

        cert, key = _self_signed(tmp_path)
        tls, context = api_tls(str(cert), str(key)), ssl.create_default_context(cafile=str(cert))
    gone = SteppedDown("127.0.0.1", 0, "node-a", Claim(2, "node-b"), tls).start()
    try:
        assert gone.address is not None
        host, port = gone.address
        scheme = "https" if https else "http"
        for path, body in (("/v1/chat/completions", b"{}"), ("/health", None)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(f"{scheme}://{host}:{port}{path}", data=body),
                                       timeout=10, context=context)
            assert e.value.code == 503 and e.value.headers["retry-after"]
            error = json.loads(e.value.read())["error"]
            assert error["code"] == "stepped_down" and "coordinator node-b of a newer term (2)" in error["message"]
    finally:
        gone.close()
        gone.close()  # (closed once more as the command ends)


def test_an_api_in_this_process_stops_once_its_tenure_is_over(dense_ckpt: Path) -> None:
    """`serve(until=...)`: the API (here in this process, as `--api-in-process` and a per-sequence engine run
    it) stops as on SIGTERM once the event is set, and serve returns 0 for `launch` to go on following."""
    import mlx.core as mx

    from mtpipe.coordinator.api.serve import serve
    from mtpipe.coordinator.engine.build import local_engine

    engine = local_engine(dense_ckpt, dtype=mx.float32)
    until, listening, out = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=lambda: out.append(serve(engine, "127.0.0.1", 0, api_process=False, until=until,
                                                              announce=lambda url: listening.set())))
    thread.start()
    try:
        assert listening.wait(60)
        until.set()
        thread.join(30)
        assert out == [0]
    finally:
        until.set()
        thread.join(30)
        engine.close()


def test_an_api_in_the_main_thread_stops_for_its_tenure_without_a_signal(dense_ckpt: Path) -> None:
    """As `launch --api-in-process` runs it (the main thread, its SIGTERM handler exiting): a tenure's end
    stops the API, and no SIGTERM is raised after it (uvicorn raises again the signals it was stopped by),
    which would end the command rather than let it follow the newer coordinator."""
    import signal

    import mlx.core as mx

    from mtpipe.coordinator.api.serve import serve
    from mtpipe.coordinator.engine.build import local_engine

    engine = local_engine(dense_ckpt, dtype=mx.float32)
    until, terms = threading.Event(), []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    try:
        rc = serve(engine, "127.0.0.1", 0, api_process=False, until=until, announce=lambda url: until.set())
        assert rc == 0 and terms == []
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()


def test_a_coordinator_whose_loads_a_newer_term_refuses_as_it_forms_follows_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Two elected at once: its members' terms read before a newer coordinator's Load came, its own Loads
    are then refused as it forms the cluster. It steps down and follows that one, as a tenure that ends
    does, where it used to exit with the refusal."""
    from mtpipe.coordinator.bench.nodes import free_port
    from mtpipe.coordinator.cli import cluster as launch_cli
    from mtpipe.coordinator.cli.main import main
    from mtpipe.models.registry import DEMO_MODEL

    node = NodeServer("127.0.0.1", 0).start()
    node.service.coordinators.see(Claim(7, "node-z"))  # (loaded since by a coordinator of term 7)
    real, asked = launch_cli.claims_at, []

    def blind_at_first(targets: Any, secret: Any, timeout: float = 1.0) -> Any:
        asked.append(targets)  # (the terms read as it is elected: before node-z's Load came)
        return [] if len(asked) == 1 else real(targets, secret, timeout)

    followed: list[str] = []

    def follow(me: str, coordinator: str, *args: Any, **kwargs: Any) -> None:
        followed.append(coordinator)
        raise KeyboardInterrupt  # (a follower's Ctrl-C: the command ends, 0)

    monkeypatch.setattr(launch_cli, "claims_at", blind_at_first)
    monkeypatch.setattr(launch_cli, "follow", follow)
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({
        "model": str(DEMO_MODEL), "discovery": {"enabled": False}, "nodes": [node.address],
        "node": {"host": "127.0.0.1", "port": free_port(), "state_dir": str(tmp_path / "state")},
        "api": {"port": free_port()}}))
    try:
        assert main(["launch", "--config", str(config), "--insecure", "--coordinator", "--api-in-process",
                     "--json"]) == 0
    finally:
        node.stop()
    assert followed == ["node-z"]
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(e["coordinator"], e["term"]) for e in events if e["event"] == "stepped_down"] == [("node-z", 7)]
