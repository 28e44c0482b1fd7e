"""The GPU engine's loop driver (rnn/_gpu_graphs.py) without a GPU: chunks of steps "captured" as
graphs that run their chunk at each replay (_gpu_graphs.emulated), on a loop written in torch whose
steps read the clock as the Triton kernels do. Checked: every step runs once, in order, for any T
(below, at and above the chunk, not a multiple of it, backward too); the captures and the memory
held do not grow with the number of distinct T (a capture per growth of the capacity); busy
entries, the memory limit, a failed capture, capture-only preparation and the environment switch.
The engine's kernels on this driver are in test_rnn_triton.py; real CUDA graphs in test_cuda.py."""

import math
import random

import pytest
import torch

import fastlayers
from fastlayers.rnn import _gpu_graphs
from fastlayers.rnn._gpu_graphs import TIME


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    _gpu_graphs.clear()
    monkeypatch.setenv(_gpu_graphs.MAX_MB, "1")  # 1 MiB: the limit is read from here, never from a GPU
    monkeypatch.delenv(_gpu_graphs.ENV, raising=False)
    monkeypatch.setattr(_gpu_graphs, "CHUNK", 4)
    monkeypatch.setattr(_gpu_graphs, "EAGER_STEPS", 0)  # every loop captured (test_small_loops_run_eagerly: not)
    before = dict(_gpu_graphs.stats)
    _gpu_graphs.stats.update(dict.fromkeys(before, 0))  # (counted from 0 here, whatever ran before)
    yield
    _gpu_graphs.stats.update(before)
    _gpu_graphs.clear()


def _chunk(st, js):
    """A time loop step by step as the kernels run it, on st's tensors only: s = clock[0] + j,
    nothing outside [0, T); step s adds x[s] to the state (a loop-carried value), writes the state
    at seen[s] and counts itself in hits[s]."""
    first, steps = (int(v) for v in st["clock"])
    for j in js:
        s = first + j
        if 0 <= s < steps:
            st["state"] += st["x"][s]
            st["seen"][s] = st["state"]
            st["hits"][s] += 1


def _prologue(st):
    st["state"].zero_()
    st["hits"].zero_()


def _loop(steps, key="k", width=3, owner=None, reverse=False):
    """One call of a loop of ``steps`` steps (x (T, width) as input); returns (loop, st)."""
    x = torch.arange(steps * width, dtype=torch.float32).view(steps, width)
    ins = {"x": x, "state": torch.zeros(width), "numbers": torch.zeros(2)}
    loop = _gpu_graphs.open(owner, (key,), steps, ins, {"seen": (TIME, width), "hits": (TIME,)}, {"x": 0})
    loop.run("forward", loop.st, _prologue, _chunk, reverse=reverse)
    return loop, loop.st


def _ran_in_order(loop, st, reverse=False):
    """Whether each of the T steps ran once, in order (the running sums of x, from the end backward)."""
    cut = loop.cut(st)
    x = cut["x"].double()
    sums = x.flip(0).cumsum(0).flip(0) if reverse else x.cumsum(0)
    return bool((cut["hits"] == 1).all()) and torch.equal(cut["seen"].double(), sums)


@pytest.mark.parametrize("value, want", [(None, "on"), ("auto", "on"), ("", "on"), ("0", "off"), ("1", "on"),
                                         ("off", "off"), ("ON", "on"), ("always", "on")])
def test_mode_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(_gpu_graphs.ENV, raising=False)
    else:
        monkeypatch.setenv(_gpu_graphs.ENV, value)
    assert _gpu_graphs.mode() == want


def test_a_bad_mode_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(_gpu_graphs.ENV, "sometimes")
    with pytest.raises(ValueError, match="FASTLAYERS_CUDA_GRAPHS must be 0, 1 or auto, got 'sometimes'"):
        _gpu_graphs.mode()


@pytest.mark.parametrize("value", ["lots", "-1", "nan", "inf"])
def test_a_bad_memory_limit_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(_gpu_graphs.MAX_MB, value)
    want = f"FASTLAYERS_CUDA_GRAPHS_MAX_MB must be a finite number of MiB >= 0, got '{value}'"
    with pytest.raises(ValueError, match=want):
        _gpu_graphs.limit_bytes(torch.device("cpu"))
    # a plain layer's capture (the path its replays take on CUDA): the setting's error, as a layer with
    # options gives it (it was reported as a failed capture, and the shape kept off graphs for good)
    from fastlayers.rnn import _gpu

    with _gpu_graphs.emulated(), pytest.raises(ValueError, match=want):
        _gpu._prepare(fastlayers.LSTM(3, 4), torch.randn(8, 2, 3), 8, False, ("a bad limit",))
    assert ("a bad limit",) not in _gpu._UNREADY


def test_cpu_tensors_capture_only_when_emulated(monkeypatch):
    assert not _gpu_graphs.enabled(torch.zeros(1))
    with _gpu_graphs.emulated():
        assert _gpu_graphs.enabled(torch.zeros(1))
        monkeypatch.setenv(_gpu_graphs.ENV, "0")
        assert not _gpu_graphs.enabled(torch.zeros(1))


@pytest.mark.parametrize("steps", [1, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "backward"])
def test_every_step_runs_once_in_order(steps, reverse):
    """T below, at, above and not a multiple of the chunk (4): the replays run steps 0..T-1
    (T-1..0 backward) once each, the same as the eager loop, in ceil(T / 4) replays."""
    eager_loop, eager = _loop(steps, reverse=reverse)
    assert _ran_in_order(eager_loop, eager, reverse) and not eager_loop.captured
    assert _gpu_graphs.stats["replays"] == 0 and _gpu_graphs.stats["captures"] == 0
    with _gpu_graphs.emulated():
        loop, st = _loop(steps, reverse=reverse)
    assert _ran_in_order(loop, st, reverse)
    assert loop.captured and _gpu_graphs.stats["captures"] == 1 and _gpu_graphs.stats["replays"] == math.ceil(steps / 4)
    torch.testing.assert_close(loop.cut(st)["seen"], eager["seen"], atol=0, rtol=0)
    assert st["seen"].size(0) == _gpu_graphs.grown(0, steps) and loop.cut(st)["seen"].size(0) == steps


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "backward"])
def test_small_loops_run_eagerly(monkeypatch, reverse):
    """Loops of at most EAGER_STEPS steps take no entry and capture nothing, their steps launched
    once each, in order, on a clock [0, T] kept per device and T (the same tensor for every call,
    never written); longer ones are captured; so is a small call that readies graphs for a longer
    T (preparing)."""
    monkeypatch.setattr(_gpu_graphs, "EAGER_STEPS", 3)
    with _gpu_graphs.emulated():
        clocks = []
        for steps in (1, 3, 3):
            loop, st = _loop(steps, reverse=reverse)
            assert _ran_in_order(loop, st, reverse) and not loop.captured
            assert st["seen"].size(0) == steps and st["clock"].tolist() == [0, steps]
            clocks.append(st["clock"])
        assert clocks[1] is clocks[2] and clocks[0] is not clocks[1]
        assert _gpu_graphs.stats["captures"] == 0 and _gpu_graphs.holding(torch.device("cpu")) == (0, 0)
        loop, st = _loop(4, reverse=reverse)
        assert _ran_in_order(loop, st, reverse) and loop.captured and _gpu_graphs.stats["captures"] == 1
        with _gpu_graphs.preparing(8) as claimed:
            loop, _ = _loop(1, key="other")
        assert loop.captured and claimed == [8]


def test_constants_are_kept_but_made_anew_inside_a_callers_capture(monkeypatch):
    """_gpu_graphs.constant keeps a read-only tensor per key; while the current CUDA stream captures (a
    graph of the caller's own, which records a fill without running it) each call makes its own."""
    made = []

    def make():
        made.append(torch.zeros(2))
        return made[-1]

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    first = _gpu_graphs.constant(("test", 1), make, cuda)
    assert _gpu_graphs.constant(("test", 1), make, cuda) is first and len(made) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    inside = [_gpu_graphs.constant(("test", 1), make, cuda) for _ in range(2)]
    assert len(made) == 3 and inside[0] is made[1] and inside[1] is made[2]


def test_values_made_inside_a_capture_are_fills_equal_to_the_copy():
    """rnn._gpu_graphs.values: a copy from the host, or inside a caller's CUDA graph capture (where a
    copy from unpinned host memory cannot be captured) one fill per value, bitwise the same numbers
    (the kernels' float64 constants exact, the clock's int32)."""
    numbers = [0.1, 1e-5, 0.3, 1 / 3, 0.0]
    for dtype in (torch.float64, torch.float32, torch.int32):
        want = torch.tensor([int(v * 10) for v in numbers] if dtype == torch.int32 else numbers, dtype=dtype)
        for made in (_gpu_graphs.values(want.tolist(), dtype, torch.device("cpu")),
                     _gpu_graphs._filled(want.tolist(), dtype, torch.device("cpu"))):
            assert made.dtype == dtype and torch.equal(made, want)
    assert torch.equal(_gpu_graphs._clock(torch.device("cpu"), 7), torch.tensor([0, 7], dtype=torch.int32))


def test_captures_and_memory_do_not_grow_with_the_number_of_distinct_t():
    """200 calls with T drawn from [10, 100] (about 90 distinct T): a capture per growth of the
    capacity only, one entry, its memory that of at most GROWTH x the longest T plus a chunk."""
    rng = random.Random(0)
    lengths = [rng.randint(10, 100) for _ in range(200)]
    growths = 0
    capacity = 0
    with _gpu_graphs.emulated():
        for steps in lengths:
            if steps > capacity:
                capacity = _gpu_graphs.grown(capacity, steps)
                growths += 1
            loop, st = _loop(steps)
            assert _ran_in_order(loop, st)
            loop.release()
    assert len(set(lengths)) > 50
    assert _gpu_graphs.stats["captures"] == growths <= 1 + math.ceil(math.log(10) / math.log(_gpu_graphs.GROWTH))
    entries, held = _gpu_graphs.holding(torch.device("cpu"))
    longest = max(lengths)
    assert entries == 1 and capacity <= _gpu_graphs.GROWTH * longest + _gpu_graphs.CHUNK
    assert held == capacity * (3 + 3 + 1) * 4 + (3 + 2) * 4  # x, seen, hits at capacity; state and numbers


def test_a_longer_t_grows_the_capacity_geometrically_and_drops_the_outgrown_entry():
    with _gpu_graphs.emulated():
        for steps, capacity in ((5, 8), (7, 8), (9, 12), (10, 12), (13, 16), (100, 100), (3, 100)):
            loop, st = _loop(steps)
            assert loop.entry.capacity == capacity and _ran_in_order(loop, st)
            loop.release()
            assert _gpu_graphs.holding(torch.device("cpu"))[0] == 1
    assert _gpu_graphs.stats["grown"] == 3 and _gpu_graphs.stats["captures"] == 4


def test_a_busy_entry_is_not_shared_and_a_released_one_is_reused():
    with _gpu_graphs.emulated():
        a, _ = _loop(6)
        b, _ = _loop(6)  # a's backward is pending: a second entry
        assert a.entry is not b.entry and a.entry.busy and b.entry.busy
        a.release()
        c, st = _loop(5)
        assert c.entry is a.entry and _ran_in_order(c, st)
    assert _gpu_graphs.stats["captures"] == 2  # c replayed a's capture


def test_release_when_the_owner_is_collected():
    class Owner:
        pass

    with _gpu_graphs.emulated():
        owner = Owner()
        loop, _ = _loop(6, owner=owner)
        entry = loop.entry
        assert entry.busy
        del owner
        assert not entry.busy


def test_idle_entries_are_dropped_least_recently_used_first():
    # 68 bytes a step (x and seen 8 float32 each, hits 1): 4096 steps about a quarter of the 1 MiB limit
    with _gpu_graphs.emulated():
        a, _ = _loop(4096, "a", width=8)
        b, _ = _loop(4096, "b", width=8)
        for loop in (a, b):
            loop.release()
        again, _ = _loop(4096, "a", width=8)  # a is now the most recently used
        again.release()
        _loop(8192, "c", width=8)  # over the limit: the least recently used idle entry (b) goes
    assert [k[0] for k in _gpu_graphs._entries] == [("a",), ("c",)] and _gpu_graphs.stats["evicted"] == 1


def test_busy_entries_are_kept_over_the_limit():
    half = 8192  # steps: about half the 1 MiB limit (see above)
    with _gpu_graphs.emulated():
        a, _ = _loop(half, "a", width=8)
        b, _ = _loop(half, "b", width=8)  # a is busy: kept, the limit is exceeded for now
        assert a.entry.busy and b.entry.busy and len(_gpu_graphs._entries) == 2
        a.release()
        _loop(half, "c", width=8)
    assert [k[0] for k in _gpu_graphs._entries] == [("b",), ("c",)]


def test_graphs_off_runs_eagerly_on_exact_buffers(monkeypatch):
    monkeypatch.setenv(_gpu_graphs.ENV, "0")
    with _gpu_graphs.emulated():
        loop, st = _loop(7)
    assert not loop.captured and st["seen"].size(0) == 7 and _ran_in_order(loop, st)
    assert not _gpu_graphs._entries and _gpu_graphs.stats["captures"] == 0


def test_a_failed_capture_warns_runs_eagerly_and_is_not_tried_again(monkeypatch):
    def failing(fn, device):
        raise RuntimeError("no graph today")

    monkeypatch.setattr(_gpu_graphs, "capture", failing)
    with _gpu_graphs.emulated():
        with pytest.warns(RuntimeWarning, match="capturing a time loop in a CUDA graph failed .*no graph today"):
            loop, st = _loop(6)
        assert _ran_in_order(loop, st)  # eagerly, on the entry's buffers
        again, st = _loop(9)
    assert not again.captured and _ran_in_order(again, st) and _gpu_graphs.stats["failed"] == 1
    assert not _gpu_graphs._entries


def test_preparing_captures_without_running():
    with _gpu_graphs.emulated():
        with _gpu_graphs.preparing(20) as claimed:
            loop, st = _loop(1)
        assert not st["hits"].any() and claimed == [loop.entry.capacity] and loop.entry.capacity >= 20
        loop.release()
        loop, st = _loop(17)  # served by the prepared entry: a replay, no capture
    assert _ran_in_order(loop, st) and _gpu_graphs.stats["captures"] == 1


def test_a_second_part_shares_the_entry_and_its_buffers():
    """The backward adds its buffers to the forward's entry (captured once, reused next call)."""
    with _gpu_graphs.emulated():
        for steps in (6, 3):
            loop, fwd = _loop(steps)
            st = loop.add({"dy": torch.ones(steps, 3)}, {"g": (TIME, 3), "absent": None}, {"dy": 0})
            assert st["x"] is fwd["x"] and st["absent"] is None and st["g"].size(0) == loop.entry.capacity
            loop.run("backward", st, _prologue, _chunk, reverse=True)
            assert _ran_in_order(loop, st, reverse=True)
            torch.testing.assert_close(loop.cut(st)["dy"], torch.ones(steps, 3))
            loop.release()
    assert _gpu_graphs.stats["captures"] == 2 and _gpu_graphs.holding(torch.device("cpu"))[0] == 1


def test_a_part_with_a_buffer_of_another_shape_gets_a_new_one_and_a_new_capture():
    with _gpu_graphs.emulated():
        for width in (3, 5, 5):
            loop, _ = _loop(6)
            st = loop.add({"dy": torch.ones(6, 3)}, {"g": (width, TIME)}, {"dy": 0})
            assert st["g"].shape == (width, loop.entry.capacity)
            loop.run("backward", st, _prologue, _chunk, reverse=True)
            assert _ran_in_order(loop, st, reverse=True)
            loop.release()
    assert _gpu_graphs.stats["captures"] == 3  # the forward's, the backward's with g of 3, then of 5


def test_an_entry_made_under_inference_mode_serves_later_calls_outside_it():
    with _gpu_graphs.emulated():
        with torch.inference_mode():
            first, _ = _loop(6)
        first.release()
        loop, st = _loop(5)  # copies its inputs into the entry's buffers: normal tensors
    assert loop.entry is first.entry and _ran_in_order(loop, st) and not st["x"].is_inference()


def test_empty_cache_drops_the_captures_and_their_buffers():
    """fastlayers.empty_cache() releases the captured loops' buffers too (it cleared the CPU pools
    only: on CUDA the captures, up to a quarter of the GPU's memory, stayed); the next call captures
    again and runs every step once."""
    import fastlayers

    with _gpu_graphs.emulated():
        loop, _ = _loop(6)
        loop.release()
        assert _gpu_graphs.holding(torch.device("cpu"))[0] == 1
        fastlayers.empty_cache()
        assert _gpu_graphs.holding(torch.device("cpu")) == (0, 0)
        loop, st = _loop(6)
        assert _ran_in_order(loop, st) and _gpu_graphs.stats["captures"] == 2
