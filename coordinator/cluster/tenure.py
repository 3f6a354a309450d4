"""A launched coordinator's term, and how it ends: a newer coordinator shows up and this one steps down.

A follower that has not heard from its coordinator for `placement.heal_after_s` is elected in its place
(follow.py), but the old coordinator may only have slept (a laptop's lid closed) or been cut off (a
partition), and come back still coordinating. Each election therefore makes a new term, one more than
the highest its members have seen (node/coordinators.py: nodes keep the newest term that loaded them,
and refuse the Loads of an older one). While it coordinates, a coordinator asks its members every
`CHECK_S` which term they know (their Ping says); once one says a term that outranks its own, its term is
over: it steps down (its API stops, what it holds on nodes is released, and it follows the newer one, as
`mtpipe launch` would have made it do). So two coordinators settle to one within a check of meeting
again, and the one that stays is always the newer: the nodes it placed keep their shards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...node.coordinators import Claim, outranks

log = logging.getLogger(__name__)

CHECK_S = 2.0  # how often a coordinator asks its members which term they know
PROBE_S = 1.0  # how long each may take to answer
UNLOAD_TIMEOUT_S = 10.0  # (a node that does not answer keeps what it holds until its leases run out)


def newest(claims: Iterable[Claim], mine: Claim) -> Claim | None:
    """The claim among `claims` that outranks all the others and `mine`; None where none outranks `mine`."""
    best = mine
    for claim in claims:
        if outranks(claim, best):
            best = claim
    return None if best == mine else best


def claims_at(targets: Sequence[str], secret: str | None, timeout: float = PROBE_S) -> list[Claim]:
    """The claims the nodes at `targets` report (their Ping, over the cluster's TLS), all asked at once;
    those that do not answer say nothing."""
    from .health import first_reachable

    targets = list(dict.fromkeys(targets))
    if not targets:
        return []
    with ThreadPoolExecutor(min(len(targets), 8), thread_name_prefix="tenure") as pool:
        reached = list(pool.map(lambda t: first_reachable([t], secret, timeout=timeout), targets))
    return [Claim(r.term, r.term_holder) for r in reached if r is not None and r.term]


class Tenure:
    """While this node coordinates under `claim`: every `check_s`, the claims of the nodes at `targets()`;
    the first that outranks it ends the tenure (`successor`, and `over` set)."""

    def __init__(self, claim: Claim, targets: Callable[[], Sequence[str]], secret: str | None,
                 check_s: float = CHECK_S):
        self.claim, self.targets, self.secret, self.check_s = claim, targets, secret, check_s
        self.successor: Claim | None = None
        self.over = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tenure", daemon=True)

    def start(self) -> Tenure:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> Claim | None:
        """One check: the newest claim that outranks this coordinator's, if a member reports one."""
        return newest(claims_at(self.targets(), self.secret), self.claim)

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                newer = self.check()
            except Exception:  # noqa: BLE001 - asked again at the next check
                log.warning("cannot ask the members which coordinator's term they know", exc_info=True)
                continue
            if newer is not None and not self._stop.is_set():
                log.warning("coordinator %s of term %d outranks this one (%s, term %d): stepping down",
                            newer.holder, newer.term, self.claim.holder, self.claim.term)
                self.successor = newer
                self.over.set()
                return


def release(engine: Any, secret: str | None) -> None:
    """Free what a coordinator that steps down holds on its pipeline's nodes: its sequences and
    subscriptions end with the engine, then each shard it alone holds is unloaded (a node that serves the
    newer coordinator refuses, and keeps its shard)."""
    import grpc

    from ...node.wire import describe_rpc_error, make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    pipeline = getattr(engine, "pipeline", None)
    client_id, addresses = getattr(pipeline, "client_id", None), list(getattr(pipeline, "addresses", []))

    def unload(address: str) -> None:
        try:
            with make_channel(address, secret) as channel:
                reply = pb_grpc.NodeStub(channel).Unload(pb.UnloadRequest(client_id=client_id),
                                                         timeout=UNLOAD_TIMEOUT_S)
        except grpc.RpcError as e:
            log.info("node %s keeps its shard: %s", address, describe_rpc_error(e))
            return
        if reply.unloaded:
            log.info("node %s unloaded the shard this coordinator placed (%.2f GiB)", address,
                     reply.freed_bytes / 2**30)

    engine.close()
    if client_id and addresses:
        with ThreadPoolExecutor(min(len(addresses), 8), thread_name_prefix="release") as pool:
            list(pool.map(unload, addresses))
