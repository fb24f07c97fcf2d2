"""Shared test set-up: one torch thread per process (2-core machines slow down 30x otherwise)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Serve kills and restarts an HTTP proxy that is not ready within 3 checks of 5 s; on a loaded 2-core machine
# a fresh proxy process takes longer than that to import, and serve.start() then fails on the killed one. The
# local Ray of the tests (and so Serve's controller) inherits this process's environment.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
# the metadata store of this test process, never the user's ~/.rollart/metadata.sqlite (a store written by
# another rollart version, or another run's jobs and pools, must not leak into a test); drivers and CLI
# subprocesses that the tests start inherit it
if "ROLLART_METADATA_DB" not in os.environ:
    _store_dir = tempfile.mkdtemp(prefix="rollart-tests-")
    atexit.register(shutil.rmtree, _store_dir, ignore_errors=True)
    os.environ["ROLLART_METADATA_DB"] = os.path.join(_store_dir, "metadata.sqlite")
# The code sandbox refuses to run code without bubblewrap (scripts/test.sh installs it). Where it is missing
# (a machine without root) the tests' own code runs unisolated, and the tests of the isolation skip.
if not any(os.access(os.path.join(d, "bwrap"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep) if d):
    os.environ.setdefault("ROLLART_SANDBOX", "unsafe-no-sandbox")
# Ray workers import worker classes defined in test modules by name: put tests/ and the repo on their path
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, os.path.dirname(_here), os.environ.get("PYTHONPATH", "")) if p
)

import pytest  # noqa: E402

# The test files that take minutes, longest first (measured on the 2-core CI machine kind; the calculator agent,
# ~5 minutes, builds its starting policy on a fresh machine). They run first: under pytest-xdist's ``--dist loadfile``
# (scripts/test.sh, with ``--no-loadscope-reorder``) files are handed out in collection order, so a long file
# never starts last while the other worker has nothing left to do. The rest keep their order.
SLOW_FILES_FIRST = (
    "test_colocated.py",
    "test_calculator_agent.py",
    "test_chaos.py",
    "test_multihost_weights.py",
    "test_core_cluster.py",
    "test_pipeline.py",
    "test_shared_cluster.py",
    "test_training_sharded.py",
    "test_weights_mooncake.py",
    "test_fault_tolerance.py",
    "test_elastic_hosts.py",
    "test_training_critic.py",
    "test_cli_first_hour.py",
    "test_testing_hosts.py",
    "test_training_megatron.py",
    "test_byo_data_run.py",
    "test_device_placement.py",
    "test_multihost.py",
    "test_envservice_hosts.py",
    "test_gpu_check.py",
    "test_kube_envpods.py",
    "test_driver_resume.py",
    "test_bench_weight_sync.py",
    "test_training_sharded_pipeline.py",
    "test_pretrained_smollm2.py",
    "test_bench_affinity.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's own order holds


# logical hardware of the shared local Ray used by the cluster tests
LOCAL_RESOURCES = {"H800": 6, "H20": 6, "CPU": 8}


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (127.0.0.1) per test session, declaring logical H800/H20 devices. A Ray this process is
    still connected to (a test that started its own and ended without shutting it down, e.g. by a timeout)
    is shut down first: its resources are not these."""
    import ray

    from rollart.resource_manager.launcher import ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    job = ensure_ray(LOCAL_RESOURCES, job_id="rollart-tests")
    yield job
    ray.shutdown()


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "metadata.sqlite"


@pytest.fixture
def make_rm(ray_local, store_path):
    """Build ResourceManagers that release their placement groups after the test."""
    from rollart.resource_manager import ResourceManager

    made = []

    def make(pools, **kw):
        kw.setdefault("store", store_path)
        rm = ResourceManager(pools, **kw)
        made.append(rm)
        return rm

    yield make
    for rm in made:
        rm.shutdown()


@pytest.fixture(scope="module")
def hosts3():
    """Three namespace hosts with a Ray cluster, shared by a test module (``rollart.testing.hosts``):
    ``head`` 10.201.0.1 (driver, train ``H800`` x2), ``b`` 10.201.0.2 (rollout ``H800`` x2), ``c`` 10.201.0.3
    (rollout ``H20`` x2). Skipped with the reason when the machine cannot build hosts (not root, no ``ip``).
    Run drivers with ``hosts3.run_driver([...])`` / ``hosts3.run_python(code, host="b")``."""
    from rollart.testing import skip_reason, start_hosts, three_hosts

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with start_hosts(three_hosts()) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _patient_sandbox():
    """The code sandbox in this process allows 10x its CPU time on the wall clock (servers default to 3x): on
    a test machine busy with other tests a sandbox is otherwise judged "contended" (no verdict, by design)
    where a test asserts the code's own verdict."""
    from rollart.reward import sandbox

    before = sandbox.limits()
    sandbox.configure(before.model_copy(update={"wall_factor": 10.0}))
    yield
    sandbox.configure(before)
