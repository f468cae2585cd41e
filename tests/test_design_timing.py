"""Gate B's timing: a sample is the mean of enough calls to last `sample_ms`, so that one slow
call (a GPU's scheduling hiccup) cannot set the extremes the claims' ranges are made of."""

import harness.design as design


class FakeClock:
    """perf_counter for a function whose every tenth call takes 10 ms and the rest 0.3 ms."""

    def __init__(self):
        self.now, self.calls = 0.0, 0

    def perf_counter(self):
        return self.now

    def fn(self):
        self.calls += 1
        self.now += 0.010 if self.calls % 10 == 0 else 0.0003


def timed(monkeypatch, sample_ms):
    clock = FakeClock()
    monkeypatch.setattr(design.time, "perf_counter", clock.perf_counter)
    return design._interleaved_ms({"write": clock.fn}, repeats=20, sample_ms=sample_ms)["write"]


def test_one_call_a_sample_leaves_the_extremes_to_single_slow_calls(monkeypatch):
    t = timed(monkeypatch, 0)
    assert t["calls"] == 1
    assert round(t["ms_min"], 9) == 0.3 and round(t["ms_max"], 9) == 10.0


def test_a_sample_times_calls_for_at_least_sample_ms_and_reports_their_mean(monkeypatch):
    t = timed(monkeypatch, 200)
    # doubling from one call after the warm-up: 128 calls (13 slow) last 164 ms, 256 (26 slow) 329
    assert t["calls"] == 256
    mean = (0.3 * 9 + 10.0) / 10  # a call's cost over a long run
    for k in ("ms", "ms_min", "ms_max"):
        assert abs(t[k] - mean) < 0.2 * mean, (k, t[k])
    assert t["ms_max"] / t["ms_min"] < 1.1  # against 33x with one call a sample


def test_the_calls_a_sample_makes_stop_doubling_at_a_bound(monkeypatch):
    monkeypatch.setattr(design.time, "perf_counter", lambda: 0.0)  # a call that takes no time at all
    assert design._calls_per_sample(lambda: None, 1) == 1 << 16
