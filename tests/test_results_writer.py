"""A run in which no round aggregated a reply says so instead of "completed"."""

from fedpower_app.runs.results import no_round_aggregated


def test_a_run_whose_rounds_aggregated_nothing_says_why():
    assert no_round_aggregated([]) is None  # no round ran: nothing to say
    rows = [{"server_round": 1, "aggregated": 0, "missing": [0, 1, 2], "dropped": []},
            {"server_round": 2, "aggregated": 0, "missing": [0],
             "dropped": [{"node": 7, "reason": "non-finite tensor lora_B"}]}]
    why = no_round_aggregated(rows)
    assert "2 round(s) ran and none aggregated" in why
    assert "4 repl(ies) never came" in why and "non-finite tensor lora_B" in why
    rows.append({"server_round": 3, "aggregated": 1, "missing": [], "dropped": []})
    assert no_round_aggregated(rows) is None  # one aggregated round: the model learned something
