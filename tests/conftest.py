"""Shared test set-up: 8 simulated CPU devices, so sharded code runs as on a pod slice."""
import os

# Must happen before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One compilation cache for the session, subprocesses included: the job tests run the same
# smoke programs in many `python -m jaxprefix.main` processes, each of which would compile
# them again. A fresh directory per session, so a test never reads another run's programs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxprefix-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# gcsfs reads this once, at import: tests only ever talk to the emulator (tests/gcs_emulator.py),
# which has no Storage Control API for gcsfs's bucket-type probe to wait on.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import collections  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

# The quick tier (`python -m pytest -m quick`, before a commit): the default suite's cheapest
# modules, whole (a module's fixtures are paid once), up to QUICK_SECONDS of their recorded
# time (tests/durations.json, written by a default run with --record-durations). A module not
# recorded yet stays out until the file is refreshed.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
QUICK_SECONDS = 150.0  # serial seconds: about a minute on two workers


def pytest_addoption(parser):
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write each test module's seconds (setup, call and teardown of its "
                          "tests) to PATH as JSON: tests/durations.json picks `-m quick`")


def quick_modules(durations: dict[str, float], budget: float = QUICK_SECONDS) -> set[str]:
    """The cheapest modules whose seconds add up to at most `budget`."""
    chosen, total = set(), 0.0
    for module, seconds in sorted(durations.items(), key=lambda item: item[1]):
        if total + seconds > budget:
            break
        chosen.add(module)
        total += seconds
    return chosen


def pytest_collection_modifyitems(config, items):
    quick = quick_modules(json.loads(DURATIONS.read_text())) if DURATIONS.exists() else set()
    for item in items:
        if (item.nodeid.split("::")[0] in quick
                and not any(item.get_closest_marker(m) for m in ("slow", "study"))):
            item.add_marker(pytest.mark.quick)


_module_seconds: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-durations")
    if path and not hasattr(session.config, "workerinput"):  # the controller's view: every test
        pathlib.Path(path).write_text(json.dumps(
            {m: round(s, 2) for m, s in sorted(_module_seconds.items())}, indent=1) + "\n")


def pytest_configure():
    """Tests compile hundreds of small programs and run each a few times: LLVM's optimisation
    of their CPU code is most of a compile and buys little at these sizes (a MoE test 120 s ->
    77 s, a training test 82 s -> 47 s), so the suites compile at -O0. It changes no figure a
    test checks: SmolLM2's greedy tokens still equal transformers' (320 s at -O0 against 352 s
    at -O2), and TPU compiles read the same HBM seconds. Benchmarks (bench/) keep the code
    generation users run. Set here, before any test initialises jax's backend; subprocesses
    inherit it."""
    if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


@pytest.fixture(scope="session")
def gcs():
    """A GCS server on 127.0.0.1 (tests/gcs_emulator.py) with bucket 'bucket'; os.environ points
    gcsfs, etils.epath and tensorstore (orbax) at it while the session lasts, subprocesses too."""
    from tests.gcs_emulator import GcsEmulator

    with GcsEmulator(buckets=("bucket",)) as emulator:
        yield emulator


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_after_each_module():
    """Every module's compiled programs are dropped when it ends: each worker process
    (pytest-xdist, `-n auto` in setup.cfg) runs a share of the suite, and a few hundred test
    programs held to the end add up."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The smoke SFT policy: an HF directory every other run starts from."""
    from tests.job_runs import run_main

    workdir = tmp_path_factory.mktemp("sft")
    run_main("configs/sft.py:smoke", workdir)
    path = workdir / "base"
    assert {"config.json", "model.safetensors", "task_tokenizer.json",
            "sft_report.json"} <= set(os.listdir(path))
    return str(path)


@pytest.fixture(scope="session")
def carry_base(tmp_path_factory):
    """The smoke SFT policy of carry_multiplication (the IsoCompute sweep's task)."""
    from tests.job_runs import run_main

    workdir = tmp_path_factory.mktemp("sft_carry")
    run_main("configs/sft.py:carry_smoke", workdir)
    return str(workdir / "base")
