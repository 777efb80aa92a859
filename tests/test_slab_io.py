"""The slab I/O's task pool under attack: urgent (reads) before plain (the writer's runs), many
posting threads at once, a writer that must never stall behind a stream of reads, shutdown with
tasks queued, tasks that raise, and posts after shutdown."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from tiering.backends.slab_io import SlabIo, cuda_driver_present, make_slab_io
from tiering.settings import SLAB_IO_URGENT_BURST

# the pool is the base class's: KvikioSlabIo runs the same tests on a GPU machine
KINDS = ["posix", pytest.param("kvikio", marks=pytest.mark.gpu)]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "kvikio":
        if not cuda_driver_present():
            pytest.skip("kvikio needs a CUDA driver (scripts/gpu_tests.sh on a GPU machine)")
        pytest.importorskip("kvikio")
    return str(request.param)


def make(kind: str, threads: int) -> SlabIo:
    io = make_slab_io(kind, threads)
    assert io.name == kind
    return io


def _gated(io: SlabIo) -> threading.Event:
    """Keep every worker of ``io`` busy until the returned event is set (each is inside its
    gate task when this returns, so what is posted next queues up)."""
    gate = threading.Event()
    inside = threading.Semaphore(0)

    def hold() -> None:
        inside.release()
        gate.wait(10.0)

    for _ in range(io.threads):
        io.post(hold)
    for _ in range(io.threads):
        assert inside.acquire(timeout=10)
    return gate


@pytest.mark.parametrize("threads", [1, 4])
def test_many_threads_posting_urgent_and_plain_tasks_run_each_exactly_once(kind, threads):
    """8 threads post 6000 tasks (urgent, plain and submit mixed) while the workers drain them:
    every task runs once, none is lost and none runs twice."""
    io = make(kind, threads)
    ran: Counter[int] = Counter()
    lock = threading.Lock()
    all_done = threading.Event()
    n_posters, per_poster = 8, 750
    total = n_posters * per_poster

    def task(i: int) -> int:
        with lock:
            ran[i] += 1
            if sum(ran.values()) == total:
                all_done.set()
        return i

    futures = []
    futures_lock = threading.Lock()

    def poster(p: int) -> None:
        rng = random.Random(p)
        for j in range(per_poster):
            i = p * per_poster + j
            kind = rng.randrange(3)
            if kind == 0:
                io.post(task, i, urgent=True)
            elif kind == 1:
                io.post(task, i)
            else:
                fut = io.submit(task, i)
                with futures_lock:
                    futures.append((i, fut))

    try:
        posters = [threading.Thread(target=poster, args=(p,)) for p in range(n_posters)]
        for t in posters:
            t.start()
        for t in posters:
            t.join(timeout=30)
        assert all_done.wait(30), f"{total - sum(ran.values())} tasks never ran"
        assert set(ran) == set(range(total))
        assert [i for i, n in ran.items() if n != 1] == []
        assert all(fut.result(timeout=5) == i for i, fut in futures)
    finally:
        io.shutdown()


def test_plain_tasks_keep_running_under_a_stream_of_urgent_ones(kind):
    """Never a stalled writer: while reads keep arriving (each urgent task posts the next, so
    the urgent queue is never empty), the writer's queued run still runs within
    SLAB_IO_URGENT_BURST urgent tasks, and plain tasks keep their order."""
    io = make(kind, 1)
    gate = _gated(io)
    urgent_ran = 0
    plain_ran: list[tuple[str, int]] = []
    stop_after = 20 * SLAB_IO_URGENT_BURST + 1000
    finished = threading.Event()

    def read(_i: int) -> None:
        nonlocal urgent_ran
        urgent_ran += 1
        if len(plain_ran) < 3 and urgent_ran < stop_after:
            io.post(read, urgent_ran, urgent=True)  # the next read arrives before this ends
        else:
            finished.set()

    def write(name: str) -> None:
        plain_ran.append((name, urgent_ran))

    try:
        for i in range(3):
            io.post(write, f"write{i}")
        for i in range(4):  # a queue of reads ahead of the writer's runs
            io.post(read, -i, urgent=True)
        gate.set()
        assert finished.wait(10)
        assert [name for name, _ in plain_ran] == ["write0", "write1", "write2"], (
            f"the writer's runs starved: {len(plain_ran)} of 3 ran after {urgent_ran} reads")
        # each write waited out at most one burst of reads
        at = [n for _, n in plain_ran]
        gaps = [b - a for a, b in zip([0, *at], at, strict=False)]
        assert max(gaps) <= SLAB_IO_URGENT_BURST, gaps
    finally:
        gate.set()
        io.shutdown()


def test_reads_still_go_first_when_the_writer_has_not_waited_a_burst(kind):
    """The bound is for starvation only: fewer queued reads than a burst all run before the
    writer's queued runs, as before."""
    io = make(kind, 1)
    gate = _gated(io)
    order: list[str] = []
    try:
        for i in range(3):
            io.post(order.append, f"w{i}")
        n = SLAB_IO_URGENT_BURST
        for i in range(n):
            io.post(order.append, f"r{i}", urgent=True)
        fut = io.submit(order.append, "last")
        gate.set()
        fut.result(timeout=5)
        assert order == [f"r{i}" for i in range(n)] + ["w0", "w1", "w2", "last"]
    finally:
        gate.set()
        io.shutdown()


def test_shutdown_runs_every_task_queued_before_it(kind):
    """Shutdown with tasks queued (the file tier's close after its last reads and writes were
    posted): each queued task runs before the workers stop, so no read leaves its key pinned
    and no write future stays pending."""
    io = make(kind, 2)
    gate = _gated(io)
    ran: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            ran.append(i)

    futs = []
    for i in range(60):
        if i % 3 == 0:
            futs.append(io.submit(task, i))
        else:
            io.post(task, i, urgent=bool(i % 2))
    stopper = threading.Thread(target=io.shutdown)
    stopper.start()
    gate.set()
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert sorted(ran) == list(range(60))
    assert all(f.done() and f.exception() is None for f in futs)


def test_a_task_that_raises_is_logged_and_its_worker_goes_on(kind, caplog):
    """A posted task must report its own failures; one that raises anyway is a logged bug,
    never a dead worker (one I/O thread: a dead one would stall every later task)."""
    io = make(kind, 1)
    try:
        io.post(lambda: 1 / 0, urgent=True)
        io.post(lambda: [][1])
        with pytest.raises(ZeroDivisionError):
            io.submit(lambda: 1 / 0).result(timeout=5)
        assert io.submit(lambda: "alive").result(timeout=5) == "alive"
        assert sum("I/O task" in r.getMessage() for r in caplog.records) == 2
    finally:
        io.shutdown()


def test_a_task_posted_after_shutdown_is_refused_not_silently_lost(kind):
    """No worker is left to run it: a silent post would leave a read's key pinned forever and
    a write's future pending (the committer waits on it); it is refused with a clear error."""
    io = make(kind, 2)
    io.shutdown()
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="shut down"):
        io.post(ran.append, 1, urgent=True)
    with pytest.raises(RuntimeError, match="shut down"):
        io.post(ran.append, 2)
    with pytest.raises(RuntimeError, match="shut down"):
        io.submit(ran.append, 3)
    assert ran == []
    io.shutdown()  # twice is harmless


def test_a_worker_that_finds_both_queues_emptied_under_it_takes_the_task_that_came():
    """Worker A finds no urgent task; before it looks at the plain ones, another worker (one
    past its burst, plain first) takes the only plain task and a new urgent one arrives with
    its token. A must take that urgent task, not die on an empty deque (a dead worker is an
    I/O thread fewer; all of them dead, a stalled writer). The interleaving is forced: the
    first look at the urgent deque hands the plain task over to it, as that race would."""
    import collections

    import tiering.backends.slab_io as slab_io

    class RacedUrgent(collections.deque):
        plain: collections.deque | None = None
        raced = False

        def popleft(self):
            if not self.raced and not self and self.plain:
                self.raced = True
                self.append(self.plain.popleft())  # taken from plain, one urgent come instead
                raise IndexError("pop from an empty deque")
            return super().popleft()

    made: list[collections.deque] = []
    orig = collections.deque  # slab_io.collections is this module: patched for the build only

    def deque_factory(*a):
        d = RacedUrgent(*a) if not made else orig(*a)
        made.append(d)
        return d

    slab_io.collections.deque = deque_factory
    gate = threading.Event()
    try:
        io = make_slab_io("posix", 1)
    finally:
        slab_io.collections.deque = orig
    try:
        made[0].plain = made[1]
        ran = threading.Event()
        io.post(gate.wait, 5.0, urgent=True)  # the worker is busy while the plain one queues
        io.post(ran.set)
        gate.set()
        assert ran.wait(5), "the worker died on an empty deque: the task never ran"
        assert made[0].raced
        done = threading.Event()
        io.post(done.set)  # and the worker is still there
        assert done.wait(5)
    finally:
        gate.set()
        io.shutdown()
