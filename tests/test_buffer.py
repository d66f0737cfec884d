"""The master's sample buffer (columns over a window of sample ids): what it answers stays right
as the window moves and grows."""

from types import SimpleNamespace

import pytest

from realcore.trainer.buffer import SampleBuffer

A = SimpleNamespace(name="a", inputs=("p",), n_seqs=2)
B = SimpleNamespace(name="b", inputs=("p", "x"), n_seqs=3)


def sizes(lengths: dict[str, list[list[int]]]) -> tuple[dict, dict]:
    """(tokens, seqs) per key and sample, as a worker's reply gives them, from every sequence's length."""
    return ({k: [sum(s) for s in v] for k, v in lengths.items()}, {k: [len(s) for s in v] for k, v in lengths.items()})


def test_samples_keep_their_keys_owners_and_costs_as_the_window_moves():
    buf = SampleBuffer([A, B])
    buf.add([0, 1], [5, 6], *sizes({"p": [[3], [4, 4]]}))
    assert len(buf) == 2 and buf.ready(A) == [5, 6] and buf.ready(B) is None
    buf.add([2] * 3, [200, 201, 202], *sizes({"p": [[1]] * 3, "x": [[7, 7, 7]] * 3}))  # far past the window: it grows
    assert buf.ready(B) == [200, 201, 202] and buf.owners([6, 201], ["p"]) == {"p": [1, 2]}
    assert buf.costs([5, 6, 200], ["p", "x"]) == [3, 8, 21] and buf.costs([5], ["nothing"]) == [1]
    assert buf.sequences(6, "p") == 2 and buf.sequences(6, "x") is None and buf.sequences(200, "x") == 3
    buf.start(A, [5, 6])
    assert buf.ready(A) == [200, 201] and buf.touched(A, [6]) and not buf.touched(B, [5, 6])
    buf.finish(A, [5, 6])
    assert buf.common_keys([5, 200]) == {"p"} and buf.common_keys([200, 202]) == {"p", "x"}
    assert buf.completed() == []
    buf.add([3, 3], [5, 6], *sizes({"x": [[2], [2]]}))
    buf.finish(B, [5, 6])
    assert buf.completed() == [5, 6]
    assert buf.holders([5, 6, 201]) == {0: [5], 1: [6], 2: [201], 3: [5, 6]}
    buf.release([5, 6])
    assert len(buf) == 3 and buf.completed() == []
    buf.add([4], [1000], *sizes({"p": [[9]]}))  # moves the window's start up to the first live id (200)
    assert buf.base == 200 and buf.ready(A) == [200, 201] and buf.costs([1000, 202], ["p"]) == [9, 1]
    buf.add([4], [150], *sizes({"p": [[2]]}))  # and back down
    assert buf.ready(A) == [150, 200] and buf.owners([150, 1000], ["p"]) == {"p": [4, 4]}
    buf.release([150, 200, 201, 202, 1000])
    assert len(buf) == 0 and buf.ready(A) is None
    buf.add([0], [7], *sizes({"p": [[1]]}))  # an empty window starts anew, with clean columns
    assert buf.base == 7 and buf.ready(A) is None and buf.completed() == [] and buf.holders([7]) == {0: [7]}


def test_adding_several_replies_at_once_moves_the_window_once_for_all():
    buf = SampleBuffer([A, B])
    buf.add([0], [10], *sizes({"p": [[1]]}))
    # the second part lies far past the window: it moves and grows before any part is written
    buf.add_many([([1, 1], [11, 12], *sizes({"p": [[2], [3]], "x": [[4], [5]]})), ([2], [500], *sizes({"p": [[6, 6]]})),
                  ([3], [13], {}, {})])
    assert buf.owners([10, 11, 12, 500], ["p"]) == {"p": [0, 1, 1, 2]} and buf.costs([10, 11, 12, 500], ["p", "x"]) == [1, 4, 5, 12]
    assert buf.common_keys([11, 12]) == {"p", "x"} and buf.sequences(500, "p") == 2 and len(buf) == 5


def test_sizes_that_do_not_line_up_are_refused():
    buf = SampleBuffer([A, B])
    with pytest.raises(ValueError, match="the same keys"):
        buf.add([0], [1], {"p": [3]}, {"x": [1]})
    with pytest.raises(ValueError, match="one entry per id"):
        buf.add([0, 0], [1, 2], {"p": [3]}, {"p": [1]})
    assert len(buf) == 0
