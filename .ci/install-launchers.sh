#!/usr/bin/env bash
# Open MPI and SLURM (with munge) from Debian's packages, for the launcher
# tests (tests/test_launchers.py: mpirun, srun, sbatch on 127.0.0.1; they
# skip, saying so, where these are absent). Idempotent: nothing is done when
# the commands are already there. Needs root (CI runs as root on a bare
# Debian machine); no daemon is started here: the tests start their own.
set -euo pipefail

need=(mpirun srun sbatch slurmctld slurmd munged)
missing=()
for c in "${need[@]}"; do
  command -v "$c" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null 2>&1 || missing+=("$c")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-launchers: Open MPI, SLURM and munge already installed"
  exit 0
fi
echo "install-launchers: missing ${missing[*]}: installing from Debian's packages"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "install-launchers: not root and no sudo: not installed; the launcher" \
         "tests will be skipped (apt-get install openmpi-bin slurmd slurmctld" \
         "slurm-client munge)" >&2
    exit 0
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# openssh-client: Open MPI's default remote agent must exist even on one node
$SUDO apt-get install -y -q --no-install-recommends \
  openmpi-bin openssh-client slurmd slurmctld slurm-client munge
echo "install-launchers: installed: $(mpirun --version 2>&1 | head -1);" \
     "slurm $(dpkg-query -W -f='${Version}' slurm-client)"
