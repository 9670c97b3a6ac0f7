#!/usr/bin/env bash
# The Python packages both servers of benchmarks/serving/compare.py and its load driver need beyond torch and
# transformers, as binary wheels for a machine with no package registry (CPython 3.12, manylinux x86_64).
#
#   bash benchmarks/serving/wheels.sh download            # here, with a registry: fills .whl/serve/ (git-ignored)
#   eval "$(bash benchmarks/serving/wheels.sh install)"   # there: into /tmp/site-serve, which goes on PYTHONPATH
#
# What they serve: `hf-paged serve` (fastapi, uvicorn, pydantic), `transformers serve` (the same, plus openai, whose
# types its handlers build, typer, which parses its flags, and accelerate, which its device_map loading needs) and
# the driver (httpx). The versions are the ones the tests pass with. `install` resolves them within the bundle alone
# (--no-index), so the set is coherent whatever the machine has; on PYTHONPATH they come before the machine's own
# copies of the same packages. accelerate (and psutil) go in without their dependencies, which torch and
# transformers bring, and only where the machine has no accelerate of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=.whl/serve
target=${SERVE_SITE:-/tmp/site-serve}
packages=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 openai==3.57.0 httpx==0.28.1
          typer==0.29.2)
only_if_missing=(accelerate==1.15.0 psutil==7.2.2)

case "${1:-}" in
  download)
    mkdir -p "$dir"
    box=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 --abi abi3 --abi none
         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
         --platform any)
    python3 -m pip download -q --dest "$dir" "${box[@]}" "${packages[@]}"
    python3 -m pip download -q --dest "$dir" "${box[@]}" --no-deps "${only_if_missing[@]}"
    ls "$dir" >&2
    du -sh "$dir" >&2
    ;;
  install)
    if [ ! -d "$dir" ]; then
      echo "wheels.sh: no $dir here; run 'bash benchmarks/serving/wheels.sh download' where a registry is" >&2
      exit 1
    fi
    if [ ! -f "$target/.complete" ]; then
      python3 -m pip install -q --no-index --find-links "$dir" --target "$target" --no-compile --no-cache-dir \
        --disable-pip-version-check "${packages[@]}" >&2
      if ! python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('accelerate') is None)"; then
        python3 -m pip install -q --no-index --find-links "$dir" --target "$target" --no-compile --no-cache-dir \
          --disable-pip-version-check --no-deps "${only_if_missing[@]}" >&2
      fi
      touch "$target/.complete"
    fi
    # stdout is for eval: PYTHONPATH gains the target, and transformers' CLI skips its online update check
    case ":${PYTHONPATH:-}:" in
      *":$target:"*) echo "export HF_HUB_DISABLE_UPDATE_CHECK=1" ;;
      *) echo "export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$target HF_HUB_DISABLE_UPDATE_CHECK=1" ;;
    esac
    ;;
  *)
    echo "usage: bash benchmarks/serving/wheels.sh download|install" >&2
    exit 2
    ;;
esac
