"""``rollart --version`` and the CLI's start-up import neither torch nor Ray; ``import rollart`` stays lazy
while ``ra.Cluster`` and friends still resolve."""

import json
import subprocess
import sys

HEAVY = ("torch", "ray", "transformers", "matplotlib", "fastapi", "uvicorn", "prometheus_client")


def _loaded_after(code: str) -> list[str]:
    """The heavy modules (and any bench module) that ``code`` imported, run in a fresh interpreter."""
    probe = code + (
        f"\nimport sys, json\nprint(json.dumps([m for m in sys.modules if m in {HEAVY!r} "
        "or m.startswith('rollart.benchmarks.')]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_version_imports_neither_torch_nor_ray():
    code = (
        "import contextlib, io\nfrom rollart.cli import main\nbuf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n    try:\n        main(['--version'])\n"
        "    except SystemExit as e:\n        assert e.code == 0\nassert buf.getvalue().startswith('rollart ')"
    )
    assert _loaded_after(code) == []


def test_help_of_the_benches_imports_none_of_them():
    code = (
        "from rollart.cli import build_parser\n"
        "try:\n    build_parser(['bench', '--help']).parse_args(['bench', '--help'])\n"
        "except SystemExit:\n    pass"
    )
    assert _loaded_after(code) == []


def test_import_rollart_is_lazy_and_the_public_names_resolve():
    assert _loaded_after("import rollart") == []
    code = (
        "import rollart as ra\nfrom rollart.cluster import Cluster\nassert ra.Cluster is Cluster\n"
        "assert {'Worker', 'register', 'ResourceManager', 'Batch'} <= set(dir(ra))\n"
        "assert all(getattr(ra, n) is not None for n in ra.__all__)"
    )
    assert "ray" in _loaded_after(code)
    try:
        _ = __import__("rollart").no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("unknown attribute resolved")


def test_every_public_name_is_lazy_and_listed():
    import rollart

    assert set(rollart.__all__) == set(rollart._LAZY) | {"__version__"}
