"""Placement: memory-proportional contiguous ranges, fixed costs at the ends, overrides, link order, hops."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_LAYERS
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpipe.coordinator.cluster.placement import (
    GiB,
    ModelFootprint,
    NodeResources,
    PlacementError,
    footprint_from_sizes,
    hop_candidates,
    largest_remainder,
    model_footprint,
    order_nodes,
    plan_layers,
)
from mtpipe.models.loading import load_shard
from mtpipe.models.shard import ShardSpec
from mtpipe.node.links import Interface, LinkType

TB, ETH, WIFI = LinkType.THUNDERBOLT, LinkType.ETHERNET, LinkType.WIFI


def fp(layers: int = 64, layer_gib: float = 1.0, embed: float = 2.0, head: float = 2.0, mtp: float = 1.0) -> ModelFootprint:
    return ModelFootprint((int(layer_gib * GiB),) * layers, int(embed * GiB), int(head * GiB), int(mtp * GiB), True)


def node(name: str, gib: float, *ifaces: Interface) -> NodeResources:
    return NodeResources(name, int(gib * GiB), tuple(ifaces), port=52416)


def test_largest_remainder() -> None:
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder([2, 1], 9) == [6, 3]
    assert largest_remainder([0.5, 0.3, 0.2], 7) == [4, 2, 1]
    assert sum(largest_remainder([3.3, 1.7, 9.1, 0.2], 61)) == 61


def test_proportional_contiguous_with_end_costs() -> None:
    f = fp()  # 64 x 1 GiB + 2 embed + 2 head + 1 MTP + 2 (embedding again on the last stage) = 71 GiB
    plan = plan_layers(f, [node("a", 100), node("b", 50), node("c", 50)])
    assert [(s.node_id, s.start, s.end) for s in plan] == [("a", 0, 33), ("b", 33, 51), ("c", 51, 64)]
    # Every node used at about the same fraction of its memory (71/200), ends included.
    assert [round(s.bytes / s.available, 2) for s in plan] == [0.35, 0.36, 0.36]
    assert plan[0].bytes == (33 + 2) * GiB and plan[-1].bytes == (13 + 2 + 1 + 2) * GiB
    equal = plan_layers(f, [node("a", 60), node("b", 60)])
    # Equal memory: the last stage carries head, MTP and embedding (5 GiB), the first only the embedding.
    assert [s.layers for s in equal] == [34, 30]


def test_refusal_says_by_how_much() -> None:
    with pytest.raises(PlacementError, match=r"model needs 71\.00 GiB, cluster has 60\.00 GiB available: 11\.00 GiB short"):
        plan_layers(fp(), [node("a", 30), node("b", 30)])
    with pytest.raises(PlacementError, match=r"model needs 69\.00 GiB, cluster has 16\.00 GiB available: 53\.00 GiB short"):
        plan_layers(fp(), [node("a", 16)])


def test_a_stage_that_cannot_fit_is_named() -> None:
    # Enough in total, but the last stage's fixed 5 GiB plus one layer do not fit on a 5.5 GiB node.
    with pytest.raises(PlacementError, match=r"node small would hold layers 63-63 .* GiB short"):
        plan_layers(fp(), [node("big", 80), node("small", 5.5)])


def test_rounding_is_repaired_by_moving_a_boundary_layer() -> None:
    f = fp(layers=10, embed=0.0, head=0.0, mtp=0.0)
    plan = plan_layers(f, [node("a", 5.4), node("b", 5.4), node("c", 100)])
    assert all(s.bytes <= s.available for s in plan)
    assert sum(s.layers for s in plan) == 10
    # The case above never needs the repair (a and b get 1 layer of 5.4 GiB). Here it does: largest
    # remainder gives a (1.6 GiB) 2 of the 10 1-GiB layers; its last layer moves to its neighbour b.
    assert largest_remainder([1.6, 5.0, 5.0], 10) == [2, 4, 4]
    plan = plan_layers(f, [node("a", 1.6), node("b", 5.0), node("c", 5.0)])
    assert [(s.node_id, s.start, s.end) for s in plan] == [("a", 0, 1), ("b", 1, 6), ("c", 6, 10)]
    assert all(s.bytes <= s.available for s in plan)


def test_a_tight_cluster_is_placed_when_any_placement_fits() -> None:
    """Where rounding and moving boundary layers to neighbours leave a stage over its node's memory, but
    some contiguous placement fits, that one is taken (the fullest node filled least)."""
    f = ModelFootprint((10,) * 9, 26, 18, 0, False)
    nodes = [NodeResources(x, m) for x, m in zip("abcd", (38, 18, 48, 48))]
    plan = plan_layers(f, nodes)
    assert [s.layers for s in plan] == [1, 1, 4, 3] and all(s.bytes <= s.available for s in plan)
    with pytest.raises(PlacementError, match="would hold"):  # one byte less on d: nothing fits
        plan_layers(f, [*nodes[:3], NodeResources("d", 47)])
    plan = plan_layers(f, nodes[:2] + [NodeResources("c", 100), NodeResources("d", 48)], {"c": 5})
    assert [s.layers for s in plan][2] == 5 and all(s.bytes <= s.available for s in plan)


def test_overrides() -> None:
    plan = plan_layers(fp(), [node("a", 100), node("b", 50), node("c", 50)], {"b": 10})
    assert [s.layers for s in plan][1] == 10 and sum(s.layers for s in plan) == 64
    plan = plan_layers(fp(), [node("a", 100), node("b", 50)], {"a": 60, "b": 4})
    assert [(s.start, s.end) for s in plan] == [(0, 60), (60, 64)]
    with pytest.raises(PlacementError, match="not in the cluster"):
        plan_layers(fp(), [node("a", 100)], {"z": 3})
    with pytest.raises(PlacementError, match="overrides give 63 of 64 layers"):
        plan_layers(fp(), [node("a", 100), node("b", 100)], {"a": 60, "b": 3})
    with pytest.raises(PlacementError, match="leaving 0 for 1 other node"):
        plan_layers(fp(), [node("a", 100), node("b", 100), node("c", 100)], {"a": 60, "b": 4})


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_cluster_is_placed_or_refused_with_a_placement_error(data: st.DataObject) -> None:
    """Whatever the layers, memory and overrides: a plan of contiguous ranges covering every layer, each
    stage within its node's memory and of its fixed size, or a PlacementError (never another error)."""
    layers = data.draw(st.lists(st.integers(5, 20), min_size=1, max_size=7))
    footprint = ModelFootprint(tuple(layers), *data.draw(st.tuples(st.integers(0, 30), st.integers(0, 10),
                                                                   st.integers(0, 10), st.booleans(),
                                                                   st.integers(0, 5))))
    nodes = [NodeResources(f"n{i}", data.draw(st.integers(0, 120)))
             for i in range(data.draw(st.integers(1, min(len(layers), 4))))]
    overrides = data.draw(st.dictionaries(st.sampled_from([n.node_id for n in nodes]), st.integers(1, len(layers)),
                                          max_size=2))
    try:
        plan = plan_layers(footprint, nodes, overrides)
    except PlacementError:
        return
    assert [s.start for s in plan] == [0, *(s.end for s in plan[:-1])] and plan[-1].end == len(layers)
    for s, n in zip(plan, nodes):
        assert s.node_id == n.node_id and s.start < s.end and s.bytes <= n.available
        assert s.end - s.start == overrides.get(n.node_id, s.end - s.start)


def test_an_override_the_last_node_cannot_hold_is_a_placement_error() -> None:
    footprint = ModelFootprint((9, 10, 19, 9, 9), 5, 1, 9, True, 2)
    with pytest.raises(PlacementError):
        plan_layers(footprint, [NodeResources("n0", 82), NodeResources("n1", 40)], {"n1": 3})


def test_tiny_nodes_still_get_a_layer() -> None:
    plan = plan_layers(fp(layers=4, embed=0, head=0, mtp=0), [node("a", 100), node("b", 1.5), node("c", 1.5)])
    assert [s.layers for s in plan] == [2, 1, 1]
    with pytest.raises(PlacementError, match="only 4 layers"):
        plan_layers(fp(layers=4, embed=0, head=0, mtp=0), [node(x, 10) for x in "abcde"])


def test_footprint_matches_loaded_shards(dense_ckpt: Path) -> None:
    f = model_footprint(dense_ckpt)
    for start, end in ((0, 1), (1, 4), (0, 4), (1, 3)):
        shard = load_shard(dense_ckpt, ShardSpec(start, end, TINY_LAYERS)).model
        assert f.stage_bytes(start, end) == shard.parameter_bytes()
    no_mtp = model_footprint(dense_ckpt, mtp=False)
    shard = load_shard(dense_ckpt, ShardSpec(1, 4, TINY_LAYERS), mtp=False).model
    assert no_mtp.stage_bytes(1, 4) == shard.parameter_bytes()


def test_footprint_counts_the_draft_vocabulary() -> None:
    """The last stage holds a copy of the draft tokens' projection rows (the demo model's tied embedding)."""
    from mtpipe.models.draft_vocab import DraftVocab, default_size
    from mtpipe.models.registry import DEMO_MODEL

    f = model_footprint(DEMO_MODEL)
    model = load_shard(DEMO_MODEL, ShardSpec(4, 8, 8)).model
    vocab = DraftVocab(model, default_size(model.config.args.vocab_size))
    assert 0 < f.draft_bytes == vocab.row_bytes < f.embed_bytes
    assert f.stage_bytes(4, 8) == model.parameter_bytes() + vocab.row_bytes
    assert f.stage_bytes(0, 4) == load_shard(DEMO_MODEL, ShardSpec(0, 4, 8)).model.parameter_bytes()
    assert model_footprint(DEMO_MODEL, mtp=False).draft_bytes == 0


def test_footprint_layouts() -> None:
    sizes = {"model.language_model.embed_tokens.weight": 100, "model.language_model.layers.0.mlp.w": 10,
             "model.language_model.layers.1.mlp.w": 20, "model.language_model.norm.weight": 1, "lm_head.weight": 100,
             "mtp.fc.weight": 7, "model.visual.blocks.0.w": 999}
    f = footprint_from_sizes(sizes, 2, mtp=True, tied=False)
    assert (f.layer_bytes, f.embed_bytes, f.head_bytes, f.mtp_bytes, f.last_needs_embedding) == ((10, 20), 100, 101, 7, True)
    tied = footprint_from_sizes(sizes, 2, mtp=False, tied=True)
    assert (tied.head_bytes, tied.mtp_bytes, tied.last_needs_embedding) == (1, 0, True)
    plain = footprint_from_sizes(sizes, 2, mtp=False, tied=False)
    assert plain.total_bytes(2) == 100 + 30 + 101 and plain.stage_bytes(1, 2) == 20 + 101
    drafts = footprint_from_sizes(sizes, 2, mtp=True, tied=False, draft_share=0.25)
    assert drafts.draft_bytes == 25 and drafts.stage_bytes(1, 2) == 20 + 101 + 7 + 25 + 100
    assert footprint_from_sizes(sizes, 2, mtp=False, tied=False, draft_share=0.25).draft_bytes == 0


# -- links and hops ----------------------------------------------------------------------------

LAN = "192.168.1.{}/24"


def cluster() -> list[NodeResources]:
    """a-b on a Thunderbolt bridge (link-local), c on Thunderbolt with only IPv6 link-local; Ethernet a-c; Wi-Fi for all."""
    a = node("a", 64, Interface("en1", WIFI, (LAN.format(1),)), Interface("en0", ETH, ("10.0.0.1/24",)),
             Interface("bridge0", TB, ("169.254.0.1/16", "fe80::a/64")))
    b = node("b", 64, Interface("en1", WIFI, (LAN.format(2),)), Interface("bridge0", TB, ("169.254.0.2/16", "fe80::b/64")))
    c = node("c", 64, Interface("en1", WIFI, (LAN.format(3),)), Interface("en0", ETH, ("10.0.0.3/24",)),
             Interface("en5", TB, ("fe80::c/64",)))
    return [a, b, c]


def test_order_prefers_best_links() -> None:
    # Four Macs cabled a-c, c-b, b-d, d-a (one subnet per cable), all on Wi-Fi.
    cables = {"a": ("c", "d"), "b": ("c", "d"), "c": ("a", "b"), "d": ("a", "b")}
    subnet = {frozenset(p): i for i, p in enumerate([("a", "c"), ("c", "b"), ("b", "d"), ("d", "a")])}
    nodes = []
    for i, x in enumerate("dcba", 1):
        tb = [Interface(f"en{k}", TB, (f"10.1.{subnet[frozenset((x, y))]}.{i}/24",)) for k, y in enumerate(cables[x], 2)]
        nodes.append(node(x, 64, Interface("en1", WIFI, (LAN.format(i),)), *tb))
    assert [n.node_id for n in order_nodes(nodes, first="a")] == ["a", "c", "b", "d"]  # the Thunderbolt ring
    assert [n.node_id for n in order_nodes(nodes, first="b")] == ["b", "c", "a", "d"]
    wifi_only = [node(x, 1, Interface("en1", WIFI, (LAN.format(i),))) for i, x in enumerate("zyxw", 1)]
    assert [n.node_id for n in order_nodes(wifi_only)] == ["w", "x", "y", "z"]  # ties: node id order
    assert [n.node_id for n in order_nodes(wifi_only, first="y")] == ["y", "w", "x", "z"]


def test_hop_candidates_best_first() -> None:
    a, b, c = cluster()
    assert [(h.target, h.link) for h in hop_candidates(a.interfaces, b)] == [
        ("169.254.0.2:52416", TB),
        ("[fe80::b%bridge0]:52416", TB),  # scoped by the connecting side's interface
        ("192.168.1.2:52416", WIFI),
    ]
    assert [(h.target, h.link) for h in hop_candidates(a.interfaces, c)] == [
        ("[fe80::c%bridge0]:52416", TB),  # link-local across links of the same kind only
        ("10.0.0.3:52416", ETH),
        ("192.168.1.3:52416", WIFI),
    ]
    # Ethernet on one side, Wi-Fi on the other, one subnet: the hop is as good as its weaker end.
    x = node("x", 1, Interface("en0", ETH, ("192.168.1.9/24",)))
    assert [(h.target, h.link) for h in hop_candidates(x.interfaces, b)] == [("192.168.1.2:52416", WIFI)]


def test_hop_fallbacks() -> None:
    a, b, _ = cluster()
    seen = NodeResources("b", 1, b.interfaces, port=7, addresses=("192.168.1.2", "172.16.0.9"))
    hops = hop_candidates(a.interfaces, seen)
    assert hops[-1].target == "172.16.0.9:7" and hops[-1].link is None  # where it was seen, last
    assert [h.target for h in hop_candidates(None, seen)] == ["192.168.1.2:7", "172.16.0.9:7"]
    lo = Interface("lo", LinkType.LOOPBACK, ("127.0.0.1/8",))
    local = NodeResources("b", 1, (lo,), port=7)
    assert [(h.target, h.link) for h in hop_candidates([lo], local)] == [("127.0.0.1:7", LinkType.LOOPBACK)]
    assert hop_candidates(a.interfaces, local) == []  # another machine's loopback is never shared


def test_static_nodes_are_reached_where_they_are_listed() -> None:
    """Static nodes (cluster.yaml `nodes:`) come with no interfaces, and this node's own advert with no
    address: the last node's ring back to the coordinator, and the weights it fetches from it, go to the
    host the coordinator is listed under, then to the coordinator's own address of it (a well-formed one)."""
    from mtpipe.coordinator.cluster.formation import link_candidates, weight_sources, with_static_host

    me = with_static_host(NodeResources("a", GiB, port=52700), NodeResources("a", GiB, port=52700,
                                                                                 addresses=("10.88.0.1",)))
    other = NodeResources("b", GiB, port=52700, addresses=("10.88.0.2",))
    assert with_static_host(other, None) is other
    control = {"a": "127.0.0.1:52700", "b": "10.88.0.2:52700"}
    assert [c.target for c in link_candidates(other, me, control)] == ["10.88.0.1:52700", "127.0.0.1:52700"]
    assert [c.target for c in link_candidates(me, other, control)] == ["10.88.0.2:52700"]
    assert weight_sources([me, other], "a", control)[1] == ["10.88.0.1:52700", "127.0.0.1:52700"]
