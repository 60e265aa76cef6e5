#!/usr/bin/env bash
# Create the virtual environment VENV (default .venv) with dpmf and everything it needs.
# Installs the CPU build of PyTorch 2.13.0 first (no multi-GB CUDA download), then dpmf with its
# extras, and Debian's Fashion-MNIST package where the system allows it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) \
      || echo "setup: could not install dataset-fashion-mnist; training falls back to scikit-learn's digits"
  else
    echo "setup: not root or no apt-get; Fashion-MNIST not installed (training falls back to digits)"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
EXTRAS="torch,test,bench,hf"
if "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  EXTRAS="$EXTRAS,fl"  # Flower 1.42 (dpmf fl) needs Python >= 3.11
else
  echo "setup: Python < 3.11: the extra fl (Flower) is skipped; dpmf fl and its tests are unavailable"
fi
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
if [ "${EXTRAS#*fl}" != "$EXTRAS" ]; then
  # Flower's simulation engine (Ray) for `flwr run examples/flower`; its tests skip without it
  "$VENV/bin/python" -m pip install -q -e ".[fl-sim]" \
    || echo "setup: could not install flwr[simulation] (Ray): flwr run examples/flower and its test are unavailable"
fi
touch "$VENV/.installed"
echo "setup: ready in $VENV"
