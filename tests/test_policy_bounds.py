"""The classic release policy's device-call bound (docs/placement-policy.md), checked on adversarial
sequences from the pool's own counters after every operation:

    device calls(t) <= G(t) + (RATE + PRATE) * A(t) + EARN * P(t) + START + PSTART

A(t): allocations so far; G(t): growths that lifted reserved memory to a new high (the only device
allocations the budget does not pay for: a pool that never releases makes them too); P(t): the sum
over those peak rises, from W to W', of (W' - W) / W' (what a growing workload earns: at most
1 + ln(peak / first growth)); RATE, START, EARN: the trade credit's constants of
cython/core/classic_policy.c, PRATE, PSTART those of the credit that keeps the pool under
torch_npu's floor. Over any window (t1, t2] the calls are at most G(t1, t2) + (RATE + PRATE) *
(A(t2) - A(t1)) + EARN * (P(t2) - P(t1)) + max(START, BASE + HOLD * A(t1)) + PSTART (the credits
held at t1): a window whose peak does not move gets no more than its allocations' share.

The sequences are built to make a policy that trades whenever it could ping-pong: phases whose
requests the other phase's idle segments cannot hold (small-pool against large-pool requests, two
size mixes), and a sawtooth whose sizes drift."""

import random

import pytest

import ascend_pool as ap

MiB = 1 << 20
# classic_policy.c: AP_TRADE_RATE and AP_TRADE_HOLD (thousandths), AP_TRADE_BASE, AP_TRADE_START,
# AP_PROTECT_RATE (thousandths) and AP_PROTECT_START
RATE, HOLD, BASE, START = 0.006, 0.003, 2, 20
PRATE, PSTART = 0.001, 10
EARN = 32  # AP_GROWTH_EARN


class Checked:
    """A pool driven op by op; after every op the bound is checked from memory_stats()."""

    def __init__(self):
        self.pool = ap.Pool(0, backend="sim", release_policy="budgeted")
        self.allocs = 0
        self.peak_growths = 0
        self.peak = 0
        self.earned = 0.0  # P(t): the peak rises' shares (W' - W) / W'
        self.history = []  # (allocs, peak growths, calls, P) after every op

    def calls(self, st):
        return st["num_device_alloc"] + st["num_device_free"]

    def check(self):
        self.pool._check_invariants()  # among them: the trade credit covers the refills of its room
        st = self.pool.memory_stats()
        peak = st["reserved_bytes.all.peak"]
        if peak > self.peak:  # at most one growth per malloc: this op's growth lifted the peak
            self.peak_growths += 1
            self.earned += (peak - self.peak) / peak
            self.peak = peak
        calls = self.calls(st)
        bound = self.peak_growths + int((RATE + PRATE) * self.allocs + EARN * self.earned + 1e-9) + START + PSTART
        assert calls <= bound, (f"after {self.allocs} allocations: {calls} device calls > G {self.peak_growths} "
                                f"+ (RATE+PRATE)*A {(RATE + PRATE) * self.allocs:.2f} + EARN*P {EARN * self.earned:.2f} "
                                f"+ START {START} + PSTART {PSTART}")
        self.history.append((self.allocs, self.peak_growths, calls, self.earned))

    def malloc(self, n):
        ptr = self.pool.malloc(n)
        self.allocs += 1
        self.check()
        return ptr

    def free(self, ptr):
        self.pool.free(ptr)
        self.check()

    def check_window(self, start):
        """The window bound from the op at index start to the end."""
        a0, g0, c0, p0 = self.history[start]
        a1, g1, c1, p1 = self.history[-1]
        bound = (g1 - g0) + (RATE + PRATE) * (a1 - a0) + EARN * (p1 - p0) + max(START, BASE + HOLD * a0) + PSTART
        assert c1 - c0 <= bound + 1e-9, f"window of {a1 - a0} allocations: {c1 - c0} calls > {bound:.2f}"
        return c1 - c0, a1 - a0

    def close(self):
        self.pool.close()


@pytest.fixture
def run():
    r = Checked()
    yield r
    r.close()


def test_small_and_large_phases_just_above_the_watermark(run):
    # Phase A: 40 MiB of 1 MiB small-pool blocks; phase B: 40 MiB of large blocks. Neither phase's
    # idle segments can hold the other's requests, so every phase change is a chance to trade.
    for cycle in range(150):
        held = [run.malloc(MiB - 32) for _ in range(40)]
        for p in held:
            run.free(p)
        held = [run.malloc(10 * MiB - 32 + (cycle % 3) * 512) for _ in range(4)]
        for p in held:
            run.free(p)
    run.check_window(len(run.history) // 2)


def test_alternating_size_mixes(run):
    rnd = random.Random(7)
    mixes = ([3, 5, 7], [11, 13, 17])
    for phase in range(200):
        sizes = [rnd.choice(mixes[phase % 2]) * MiB + rnd.randrange(0, MiB, 512) for _ in range(rnd.randint(4, 9))]
        held = [run.malloc(s) for s in sizes]
        rnd.shuffle(held)
        for p in held:
            run.free(p)
    calls, allocs = run.check_window(len(run.history) // 2)
    assert calls <= 0.01 * allocs  # the steady-state target


def test_sawtooth_with_drifting_sizes(run):
    size = 2 * MiB
    for tooth in range(120):
        held = [run.malloc(int(size * (1 + k / 8))) for k in range(8)]
        keep = held.pop(tooth % 8)  # one block outlives its tooth: segments free up unevenly
        for p in held:
            run.free(p)
        run.free(keep)
        size = int(size * 1.03) if tooth % 40 < 20 else int(size / 1.03)
    run.check_window(len(run.history) // 2)


def test_a_growing_peak_pays_for_its_trades_and_the_credit_held_stays_capped(run):
    # Ever larger requests, each freed: every growth could trade the idle segment for itself, and
    # each lifts the peak a little, earning EARN * (W' - W) / W' calls. The trades are paid from
    # that and from the starting credits, no more (every op is checked against the bound).
    for i in range(40):
        run.free(run.malloc((10 + 2 * i) * MiB))
    st = run.pool.memory_stats()
    assert 0 < st["num_device_free"] <= (START + PSTART + (RATE + PRATE) * run.allocs + EARN * run.earned) / 2
    assert st["reserved_bytes.all.peak"] < 200 * MiB  # never-releasing would hold 1,960 MiB
    # After a jump of the peak (20x), the window of ever larger requests that follows stays within
    # the window bound: its own allocations' and peak rises' share plus the credits held.
    run.free(run.malloc(2000 * MiB))
    start = len(run.history) - 1
    for i in range(40):
        run.free(run.malloc((2002 + 2 * i) * MiB))
    run.check_window(start)


def test_past_the_credit_idle_segments_keep_the_pool_under_torch_npus_floor(run):
    # torch_npu's never-release policy holds at least the highest bytes ever allocated per pool (in
    # 2 MiB segments): 240 MiB here, and the pool reserves exactly that. Then ever larger requests,
    # each freed (none fits the idle segments, and each outgrows the last trade's segment): the
    # first trades spend the credit; past it each growth would lift the pool above that floor
    # while idle segments could pay for it, so the floor's own credit trades instead.
    held = [run.malloc(12 * MiB - 32) for _ in range(20)]
    for p in held:
        run.free(p)
    floor = run.pool.memory_stats()["reserved_bytes.all.peak"]
    assert floor == 240 * MiB
    for i in range(10):
        run.free(run.malloc((13 + 12 * i) * MiB))
    st = run.pool.memory_stats()
    calls = st["num_device_alloc"] + st["num_device_free"] - 20
    assert calls > START + RATE * run.allocs  # more than the trade credit: the floor's was spent too
    # No request got fresh memory on top of the floor (each is >= 13 MiB); a trade whose credit
    # covers only part of its releases may leave a page above it.
    assert st["reserved_bytes.all.peak"] < floor + 13 * MiB
