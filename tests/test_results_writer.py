"""ResultsWriter: a run in which no round aggregated a reply says so instead of "completed"."""

from fedpower_app.runs.results import ResultsWriter


def test_a_run_whose_rounds_aggregated_nothing_says_why(tmp_path):
    w = ResultsWriter(tmp_path, {"seed": 0})
    assert w.no_round_aggregated() is None  # no round ran: nothing to say
    w.add_round({"server_round": 1, "aggregated": 0, "missing": [0, 1, 2], "dropped": []})
    w.add_round({"server_round": 2, "aggregated": 0, "missing": [0],
                 "dropped": [{"node": 7, "reason": "non-finite tensor lora_B"}]})
    why = w.no_round_aggregated()
    assert "2 round(s) ran and none aggregated" in why
    assert "4 repl(ies) never came" in why and "non-finite tensor lora_B" in why
    w.add_round({"server_round": 3, "aggregated": 1, "missing": [], "dropped": []})
    assert w.no_round_aggregated() is None  # one aggregated round: the model learned something
