"""Records the order of a runner's step launches and waits: ("launch", n, placeholder rows) and ("wait", n)."""

from __future__ import annotations


def spy_on_launches(runner, events: list) -> None:
    """Replace runner.launch (an instance attribute: undo with `del runner.launch` or monkeypatch)."""
    launch = runner.launch

    def spy_launch(inp, previous=None, proposal=None):
        n = sum(1 for e in events if e[0] == "launch")
        events.append(("launch", n, 0 if inp.from_previous is None else inp.from_previous.shape[1]))
        step = launch(inp, previous, proposal)
        output = step.output

        def spy_output():
            events.append(("wait", n))
            return output()

        return type("Spied", (), {"tokens": step.tokens, "accepted_counts": step.accepted_counts, "head_state": step.head_state,
                                  "output": staticmethod(spy_output)})()

    runner.launch = spy_launch
