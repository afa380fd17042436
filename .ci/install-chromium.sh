#!/usr/bin/env bash
# Debian's Chromium (and a font, so that screenshots show text) for
# `make docs-check` (.ci/docs_check.py opens the built site in it). Idempotent:
# nothing is done when /usr/bin/chromium is there. Needs root (CI runs as
# root on a bare Debian machine); without root or sudo nothing is installed
# and `make docs-check` fails, naming this script.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  echo "install-chromium: $(/usr/bin/chromium --version 2>/dev/null | head -1) already installed"
  exit 0
fi
echo "install-chromium: /usr/bin/chromium missing: installing Debian's package"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "install-chromium: not root and no sudo: not installed (apt-get" \
         "install chromium fonts-dejavu-core); make docs-check will fail" >&2
    exit 0
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
echo "install-chromium: installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
