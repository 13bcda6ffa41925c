"""Shared fixtures: small MONA files (both schemas, broken variants) and temporary run dirs."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test`'s two workers and the smoke study's processes share two cores. torch's OpenMP
    # threads (libgomp) spin while they wait, which takes the core from the other process's
    # threads: two 2-thread processes at once took 91 s where one took 10.5 (bench/omp_wait.py;
    # passive: 14 s, the same output bytes). The study's kernels and training processes inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
MONA = ROOT / "data" / "raw" / "MONA_From2002.csv"

#: Vintage column -> current IMF export column (SOURCE.md), for building a current-schema file.
TO_CURRENT = {
    "CountryName": "Country Name",
    "ArrID": "Arrangement Number",
    "ArrType": "Arrangement Type",
    "ApprovalDate": "Approval Date",
    "BoardActDate": "Board Action Date",
    "ReviewType": "Review Type",
    "EconDescrpt": "Economic Descriptor",
    "Descpt": "Description",
    "SPC_PA_SB": "Description Code",
    "TestDate": "Test Date",
    "Status": "PC Status",
}


def read_rows(n: int | None = None) -> tuple[list[str], list[list[str]]]:
    with open(MONA, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    return rows[0], rows[1 : None if n is None else n + 1]


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(header)
    w.writerows(rows)
    path.write_text(buf.getvalue(), encoding="utf-8", newline="")
    return path


@pytest.fixture(scope="session")
def mona_path() -> Path:
    return MONA


@pytest.fixture
def small_mona(tmp_path: Path) -> Path:
    """The first 300 rows of the real vintage file."""
    header, rows = read_rows(300)
    return write_csv(tmp_path / "small.csv", header, rows)


@pytest.fixture
def current_schema_mona(tmp_path: Path) -> Path:
    """The same 300 rows under the current IMF export's column names, with an economic code."""
    header, rows = read_rows(300)
    keep = [h for h in header if h in TO_CURRENT]
    idx = [header.index(h) for h in keep]
    new_header = [TO_CURRENT[h] for h in keep] + ["Economic Code"]
    new_rows = [
        [r[i] for i in idx] + ["20." + r[header.index("EconDescrpt")].split(".")[0]] for r in rows
    ]
    return write_csv(tmp_path / "current.csv", new_header, new_rows)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` runs the suite on two pytest-xdist workers, a file to a worker in collection
    order (`--dist loadfile --no-loadscope-reorder`). The smoke study (`smoke_run`, about a
    third of the suite's CPU time, using about one core of two) and the tests that read it are
    the longest chain: under xdist tests/test_smoke_study.py comes first, so one worker starts
    the study at once, and every other file that reads it comes last, so the other worker runs
    the rest beside it before it waits for the study and then takes a share of its tests."""
    xdist = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # a plain `pytest` keeps the order
    readers = {i.path for i in items if "smoke_run" in getattr(i, "fixturenames", ())}

    def rank(item: pytest.Item) -> int:
        if not xdist:
            return 1
        if item.path.name == "test_smoke_study.py":
            return 0
        return 2 if item.path in readers else 1

    # Order dependence made visible: `RLXF_TEST_ORDER_SEED=1 make test` runs the files in a
    # seeded random order, shuffled within each rank above, each file's tests in their order.
    files = list(dict.fromkeys(i.path for i in items))
    if (seed := os.environ.get("RLXF_TEST_ORDER_SEED")) is not None:
        import random

        random.Random(seed).shuffle(files)
    place = {f: n for n, f in enumerate(files)}
    items.sort(key=lambda i: (rank(i), place[i.path]))  # stable: a file's tests keep their order


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = os.environ.get("RLXF_TEST_ORDER_SEED")
    return f"files in a shuffled order: RLXF_TEST_ORDER_SEED={seed}" if seed is not None else None


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole smoke study and its report, built once per `pytest` run (under xdist, once for
    both workers) and read-only after: `smoke.shared_smoke_run`."""
    from smoke import shared_smoke_run

    return shared_smoke_run(tmp_path_factory)


@pytest.fixture
def one_thread():
    """Tiny models run far faster on one thread (and do not fight the shared cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


if os.environ.get("RLXF_TEST_AUTOCAST"):
    # A device check: every test that takes the policy settings' default runs its matmuls under
    # this autocast dtype (e.g. `RLXF_TEST_AUTOCAST=bfloat16` on a GPU). Off by default.
    from rlxf_utils.config.policy import PolicyConfig

    PolicyConfig.model_fields["autocast"].default = os.environ["RLXF_TEST_AUTOCAST"]
    PolicyConfig.model_rebuild(force=True)
    assert PolicyConfig().autocast == os.environ["RLXF_TEST_AUTOCAST"]


@pytest.fixture(autouse=True)
def _sigint_guard(request: pytest.FixtureRequest):
    """Every test leaves SIGINT's handler as it found it; one that changes it fails, naming
    itself and the handler it left, and the handler is put back for the next test.

    `_thread.interrupt_main()` (the interrupt tests' simulated Ctrl-C) calls whatever Python
    handler SIGINT has: a handler left behind by an earlier test on the same worker (asyncio's
    no-op from `loop.add_signal_handler`, say) swallows it, and the interrupt test fails far
    from the leak (issue 82). Tests that need Python's own handler take `python_sigint`."""
    import signal

    found = signal.getsignal(signal.SIGINT)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not found:
        signal.signal(signal.SIGINT, found)
        pytest.fail(f"{request.node.nodeid} left SIGINT's handler as {left!r} (found {found!r})",
                    pytrace=False)  # fmt: skip


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (`signal.default_int_handler`, which raises
    KeyboardInterrupt) for the test's duration, for a test that interrupts the main thread.

    It finds either that handler or SIG_IGN (a shell starts background jobs with SIGINT ignored,
    and Python then installs none); anything else is a leak from an earlier test, which fails
    here instead of as a swallowed interrupt."""
    import signal

    found = signal.getsignal(signal.SIGINT)
    assert found in (signal.default_int_handler, signal.SIG_IGN), (
        f"SIGINT's handler is {found!r} before this test: an earlier test left it changed"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)
