"""Which coordinators a node serves: plain decisions over client ids (node/service.py acts on them).

Coordinators may share the shard a node holds (each runs its own sequences on it), but none replaces
it under another that is connected (subscribed), unless it takes the node over: the others'
subscriptions end then, and with them their requests on this node. `clients` are the coordinators
whose Load the held shard answers; frames of any other are refused, so a coordinator whose shard was
replaced fails at once instead of running on layers it did not ask for. A coordinator taken over is
told so, and its Loads stay refused here: it does not take the node back when the other one leaves.

Coordinators that `mtpipe launch` runs have a term (an epoch, as Raft's): an election makes the next one
(one more than the highest its members say they have seen). A node keeps the newest term it has seen
(`Claim`), refuses the Load of a coordinator whose term that one outranks (so a coordinator that slept
through an election never forms again over the nodes the new one holds), and takes itself over for a
coordinator whose term outranks it. Pings report the claim, which is how the old coordinator learns
that its term is over and steps down (coordinator/cluster/tenure.py). There are no votes: two
coordinators elected apart (a partition) may share a term, and then the lower node id outranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

KEEP_DISPLACED = 64  # coordinators remembered as taken over (each restart of one is a new id)


class Claim(NamedTuple):
    """A coordinator's term and its node id (term 0: none, a coordinator outside `mtpipe launch`)."""

    term: int = 0
    holder: str = ""


def outranks(a: Claim, b: Claim) -> bool:
    """Whether `a` is the newer coordinator: the higher term, or on one term (two elected apart) the
    lower node id. No claim (term 0) outranks nor is outranked."""
    if not a.term or not b.term:
        return False
    return a.term > b.term or (a.term == b.term and a.holder < b.holder)


def next_term(seen: Iterable[int]) -> int:
    """The term of a coordinator elected now: one more than the highest its members have seen."""
    return max(seen, default=0) + 1


class Coordinators:
    def __init__(self) -> None:
        self.clients: set[str] = set()  # empty: not known (a coordinator that did not say who it is)
        self.displaced: OrderedDict[str, str] = OrderedDict()  # coordinator taken over -> the one that took it
        self.claim = Claim()  # the newest coordinator's term this node has seen
        self.terms: dict[str, int] = {}  # the term of each of `clients` that had one

    def see(self, claim: Claim) -> bool:
        """Keep `claim` where it is the newest seen (or the first); whether it is."""
        if outranks(claim, self.claim) or (claim.term and not self.claim.term):
            self.claim = claim
            return True
        return claim == self.claim

    def stale(self, claim: Claim) -> bool:
        """A Load of `claim` is refused: the node has seen a newer coordinator."""
        return outranks(self.claim, claim)

    def supersedes(self, claim: Claim) -> bool:
        """A Load of `claim` takes the node over from the coordinators of the term it has now."""
        return outranks(claim, self.claim)

    def of_terms(self, me: str, subscribed: Iterable[str]) -> list[str]:
        """The coordinators (subscribed, or whose Load the shard answers) a Load of a newer term than the
        node's ends: those of a term. One of none (`serve --nodes`) takes no part in elections: it shares
        the shard with the newer one, or refuses it another, as before terms."""
        return [c for c in dict.fromkeys([*subscribed, *self.clients]) if c and c != me and self.terms.get(c)]

    def supersede(self, older: Iterable[str], me: str, term: int) -> None:
        """`me`'s Load (of `term`) was admitted: the coordinators of `older` terms are taken over."""
        for c in older:
            self.clients.discard(c)
            self.displaced[c] = me
            while len(self.displaced) > KEEP_DISPLACED:
                self.displaced.popitem(last=False)
        self.terms = {c: t for c, t in self.terms.items() if c in self.clients}
        if me and term:
            self.terms[me] = term

    def admits(self, client_id: str) -> bool:
        """Not a coordinator whose shard another one's Load replaced here."""
        return not self.clients or not client_id or client_id in self.clients

    def refuses(self, me: str, subscribed: Iterable[str], reused: bool, take_over: bool, loaded: bool = True) -> bool:
        """Whether `me`'s Load is refused: another connected coordinator holds another shard here, or
        `me` was taken over here (`displaced` says by whom). A node that holds no shard (`loaded`
        false: new, or started again) holds none of anyone's: coordinators subscribed to it all wait
        for their Loads, and the first one's shard is what the others then share or are refused.
        Changes nothing: a Load is checked (weights found, layers fit the model) before it is admitted."""
        holders = self._others(me, subscribed) if loaded else []
        return not take_over and (me in self.displaced or (bool(holders) and not reused))

    def _others(self, me: str, subscribed: Iterable[str]) -> list[str]:
        return [c for c in subscribed if c != me and self.admits(c)]

    def admit_load(self, me: str, subscribed: Iterable[str], reused: bool, take_over: bool,
                   loaded: bool = True) -> list[str] | None:
        """None: refused (`refuses`). Else the coordinators whose subscriptions end (taken over).
        `clients` is settled now, before the shard is read, so that none of the others can come back
        meanwhile."""
        if self.refuses(me, subscribed, reused, take_over, loaded):
            return None
        others = self._others(me, subscribed)
        self.displaced.pop(me, None)
        if not me:
            self.clients = set()
        elif reused and not take_over:
            if self.clients:
                self.clients.add(me)
        else:
            self.clients = {me}
        if not take_over:
            return []
        for c in filter(None, others):
            self.displaced[c] = me
            while len(self.displaced) > KEEP_DISPLACED:
                self.displaced.popitem(last=False)
        return others


def taken_over(node: str, by: str) -> str:
    """What a coordinator taken over hears (its subscription's last event, and its Loads' refusal)."""
    return (f"{node} was taken over by coordinator {by}: this coordinator no longer serves on it "
            "(start it again with --take-over to take the node back)")


def superseded(node: str, newest: Claim, claim: Claim) -> str:
    """What a coordinator of an earlier term hears (its Load refused, or its subscription ended)."""
    return (f"{node} serves coordinator {newest.holder} of term {newest.term}: the term {claim.term} of this "
            "coordinator is over (it was elected earlier, or apart), and it steps down")


def relink(others: bool, now: str, answered: str | None, asked: str, asked_id: str) -> str:
    """What a Connect does with one of a node's links (to its next node, or the ring's to the first)
    where other coordinators are subscribed to it (`others`): "set" it as asked where none are, or where
    it leads nowhere now (`now` "": none; `answered` None: the node linked does not answer); "keep" it
    where it leads to the node asked for (by its id where told, which a restarted node may answer at the
    same address, else by the address); else "refuse": another coordinator's rounds go through it."""
    if not others or not now or answered is None:
        return "set"
    return "keep" if (answered == asked_id if asked_id else asked == now) else "refuse"
