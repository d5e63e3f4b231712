"""The forecast planned collectives are agreed from ([Note: planned collectives] in
zerokern/zero/comm/check.py): pure, so every rank that saw the same agreed collectives
forecasts the same ones."""

from zerokern.zero.comm.forecast import CONTEXT, KEEP, Forecast


def _fed(codes):
    f = Forecast()
    for c in codes:
        f.append(c)
    return f


def test_a_repeating_step_is_forecast_past_its_end():
    step = [10, 11, 12, 10, 13, 14, 15]  # unit 10 gathered twice a step: told apart by its neighbours
    f = _fed(step * 2)
    assert f.ahead((), 9) == (step * 2)[:9]
    assert f.ahead([10], 4) == [11, 12, 10, 13]  # after this rank's own collectives not agreed yet
    assert f.end == 14


def test_nothing_is_forecast_without_a_match():
    assert _fed([1, 2]).ahead((), 3) == []
    assert _fed([1, 2, 3, 4]).ahead((), 3) == []  # this context was never seen before
    assert _fed([1, 2, 3, 1, 2, 3]).ahead([9], 2) == []


def test_truncating_forgets_what_followed():
    f = _fed([1, 2, 3] * 3)
    f.truncate(4)
    assert f.end == 4 and f.codes == [1, 2, 3, 1]
    assert f.ahead((), 2) == []  # (2, 3, 1) ends at 3: nothing after it was seen yet... until it was
    f.append(2), f.append(3)
    assert f.ahead((), 3) == [1, 2, 3]


def test_a_long_run_keeps_a_bounded_past_and_the_same_forecast():
    step = list(range(100, 100 + 37))
    f = _fed(step * (3 * KEEP // len(step)))
    assert len(f.codes) <= 2 * KEEP and f.end == len(step) * (3 * KEEP // len(step))
    assert f.ahead((), len(step)) == step[f.end % len(step):] + step[:f.end % len(step)]
    assert CONTEXT >= 2
