#!/usr/bin/env bash
# Pack what a bare GPU machine without network access needs to run rollart (docs/gpus.md, "On a bare GPU
# machine"): such a machine has Python, CUDA torch, transformers and peft, but no Ray, pydantic or rollart.
#
#   bash scripts/device_bundle.sh [DIR]        # default DIR: .devbundle (git-ignored: info/exclude)
#   there:  source DIR/setup.sh && bash scripts/gpu_check.sh --out "$OUT"
#
# DIR holds Ray's wheel for that machine's Python, unpacked without the parts rollart does not use (Java
# jars, RLlib, ray.llm, the dashboard's web build) and packed again (about 42 MB), the wheels of
# pydantic, jsonschema, pytest-asyncio and megatron-core, a wheel of this checkout, and setup.sh, which
# installs them under /tmp/site. Environment: PY_VERSION (3.12), RAY_VERSION (2.60.0), EXTRA (more
# "name==version" wheels). Rerun after changing the checkout: the rollart wheel is rebuilt every time.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dir=${1:-.devbundle}
py=${PY_VERSION:-3.12}
ray_version=${RAY_VERSION:-2.60.0}
mkdir -p "$dir/wheels"
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # also right in a git worktree
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >>"$exclude"

download() {  # wheels for the device's CPython on x86-64 Linux, without their dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}

if [ ! -f "$dir/ray-$ray_version.tar.gz" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  download "$work" "ray==$ray_version"
  python3 - "$work"/ray-*.whl "$work/tree" <<'PY'
import os
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
unused = ("ray/jars/", "ray/rllib/", "ray/llm/", "ray/dashboard/client/build/")
with zipfile.ZipFile(wheel) as z:
    for member in z.infolist():
        if member.filename.startswith(unused):
            continue
        path = z.extract(member, dest)
        mode = (member.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
  tar -czf "$dir/ray-$ray_version.tar.gz" -C "$work/tree" .
fi

for want in pydantic pydantic-core annotated-types typing-inspection typing-extensions jsonschema \
  jsonschema-specifications referencing rpds-py pytest pytest-asyncio megatron-core==0.16.1 ${EXTRA:-}; do
  name=$(echo "${want%%==*}" | tr - _)
  ls "$dir/wheels" | grep -qi "^$name-" || download "$dir/wheels" "$want"
done
rm -f "$dir"/wheels/rollart-*.whl
python3 -m pip wheel -q --no-deps . -w "$dir/wheels"

cat >"$dir/setup.sh" <<'SH'
# Sourced from the project root on the device machine: installs the bundle under /tmp/site.
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/site
[ -d /tmp/site/ray ] || tar -xzf "$bundle"/ray-*.tar.gz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/wheels/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi -L || true
python3 -c "import ray, rollart, torch; print('ray', ray.__version__, 'rollart', rollart.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
SH
du -sh "$dir"
