"""A node's conditions (Health's last_error): its own faults, never a request's."""

from __future__ import annotations

from mtpipe.node.conditions import TRANSIENT_S, Conditions


def test_a_refused_request_or_a_round_no_longer_expected_is_no_condition_of_the_node() -> None:
    c = Conditions()
    c.failed("INVALID_ARGUMENT", "a malformed step")
    c.failed("ABORTED", "group 1 is unknown here, yet its round carries rows that do not join")
    assert c.current() is None
    c.failed("INTERNAL", "RuntimeError: boom")
    message, since = c.current()
    assert message == "RuntimeError: boom"
    assert c.current(now=since + TRANSIENT_S + 1) is None  # a failed round is shown for a while


def test_a_lasting_condition_holds_until_cleared_and_keeps_its_start() -> None:
    c = Conditions()
    c.set("link", "lost the next node", transient=False)
    since = c.current()[1]
    c.set("link", "lost the next node")
    assert c.current() == ("lost the next node", since)
    assert c.current(now=since + 10 * TRANSIENT_S) == ("lost the next node", since)
    c.clear("link")
    assert c.current() is None
