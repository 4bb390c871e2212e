"""Multi-stage collector sides as stage machines (protocols.staged): the graph is data, every move of a real
collector side is one of its transitions, and a move the graph does not list is refused."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.base import MisuseError, ProtocolError
from protocols.messages import Decision, ReportBatch, Threshold
from protocols.staged import ADVANCE, CLOSE, IDLE, REQUEST, StageGraph
from scenarios import schema


def _collector(scenario: str, n: int = 16):
    return schema.load(scenario).protocol.make_collector(n)


def _walk(col, rounds: int) -> list[tuple[str, str, str]]:
    """Drive ``rounds`` rounds with no reports, recording every (state, event, next state)."""
    moves = []
    for t in range(1, rounds + 1):
        before = col.state
        col.request(t, 1.0)
        moves.append((before, REQUEST, col.state))
        while True:
            before = col.state
            msg = col.advance(2.0)
            if msg is None:
                assert col.state == before  # a stage with no advance stays open until the round closes
                break
            moves.append((before, ADVANCE, col.state))
            assert isinstance(msg, (Decision, Threshold)) and msg.round == t
        before = col.state
        col.close_round()
        moves.append((before, CLOSE, col.state))
    return moves


@pytest.mark.parametrize("scenario", ["thresh_stable", "topl_pos"])
def test_every_move_of_a_real_collector_is_a_transition_of_its_graph(scenario):
    col = _collector(scenario)
    moves = _walk(col, 4)
    for state, event, target in moves:
        assert target in col.GRAPH.transitions[(state, event)], (state, event, target)
    # and the graph holds nothing the protocol never does in these rounds
    assert {(s, e) for s, e, _ in moves} == set(col.GRAPH.transitions)


def test_thresh_epoch_is_vote_then_estimate_and_topl_opens_holdout_only_in_threshold_rounds():
    moves = _walk(_collector("thresh_stable"), 1)
    assert moves == [(IDLE, REQUEST, "vote"), ("vote", ADVANCE, "estimate"), ("estimate", CLOSE, IDLE)]
    topl = _collector("topl_pos")
    firsts = [m[2] for m in _walk(topl, 3) if m[1] == REQUEST]
    assert firsts == ["holdout" if topl.params.threshold_round(t) else "report" for t in (1, 2, 3)]
    assert firsts[0] == "holdout" and "report" in firsts


def test_a_move_the_graph_does_not_list_is_local_misuse_and_a_batch_with_nothing_open_a_peer_error():
    col = _collector("thresh_stable")
    with pytest.raises(MisuseError, match="not a transition"):
        col.close_round()  # nothing open
    col.request(1, 1.0)
    with pytest.raises(MisuseError, match="not a transition"):
        col.close_round()  # the votes have not closed: the epoch cannot end in the vote stage
    with pytest.raises(MisuseError, match="not a transition"):
        col.request(2, 1.0)  # a round is open
    col.advance(2.0)
    col.close_round()
    batch = ReportBatch(1, col.name, np.arange(2, dtype=np.uint32), {"vote": np.zeros(2, np.uint8)})
    with pytest.raises(ProtocolError, match="no stage is open"):
        col.receive(batch)


def test_a_snapshot_stops_only_between_rounds_or_at_an_empty_stage_entered_by_advance():
    col = _collector("thresh_stable")
    col.request(1, 1.0)
    with pytest.raises(MisuseError, match="snapshotted between rounds"):
        col.snapshot()
    decision = col.advance(2.0)
    state = col.snapshot()
    assert state["open_stage"] == "estimate"
    fresh = _collector("thresh_stable")
    fresh.restore(state)
    assert fresh.state == "estimate" and fresh.open_message(2.0) == decision


def test_a_graph_naming_an_unknown_state_or_event_is_refused():
    with pytest.raises(ValueError, match="unknown state"):
        StageGraph(("a",), {(IDLE, REQUEST): ("b",)})
    with pytest.raises(ValueError, match="unknown state"):
        StageGraph(("a",), {("a", "jump"): (IDLE,)})
    chain = StageGraph.chain("a", "b", "c")
    assert chain.transitions == {(IDLE, REQUEST): ("a",), ("a", ADVANCE): ("b",), ("b", ADVANCE): ("c",),
                                 ("c", CLOSE): (IDLE,)}
    assert chain.entered_by_advance() == {"b", "c"}
