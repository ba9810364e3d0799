#!/usr/bin/env bash
# The first-run check (`make test-fresh`): what a new user gets from `git clone` + `make test` on a
# machine that never ran the suite. A fresh clone of HEAD (commit first: uncommitted changes are
# not in it), new virtualenvs, and every lab cache pointed at an empty directory, so that the
# Podman image, Apptainer and the SIF are built again by the tests' own fixtures. The Debian
# packages are not removed (apt is the machine's, not the lab's). Prints the wall time, set-up
# included, and the exit status; removes the Podman image it made. The clone (about 8 GB: three
# virtualenvs, the lab's caches) is removed when the run passes and kept for reading when it fails
# (HPCRL_FRESH_KEEP=1 keeps it either way): kept clones fill a disk that a later run needs.
set -euo pipefail
src="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
work="$(mktemp -d "${TMPDIR:-/tmp}/hpcrl-fresh.XXXXXX")"
git clone -q "$src" "$work/hpcrl"
export CI=true
export HPCRL_LAB_CACHE="$work/lab-cache" HPCRL_LAB_APPTAINER="$work/lab-apptainer"
mkdir -p "$HPCRL_LAB_CACHE" "$HPCRL_LAB_APPTAINER"
cd "$work/hpcrl"
echo "fresh check: $(git rev-parse --short HEAD) in $work/hpcrl, lab caches $HPCRL_LAB_CACHE and $HPCRL_LAB_APPTAINER"
start=$(date +%s)
status=0
bash .ci/run < /dev/null || status=$?
echo "fresh check: exit status $status after $(( $(date +%s) - start )) s, set-up included"
image="$(python3 -c 'from tests.lab.config import IMAGE; print(IMAGE)')"
podman image rm -f "$image" > /dev/null 2>&1 || true
cd /
if [ "$status" = 0 ] && [ "${HPCRL_FRESH_KEEP:-0}" != 1 ]; then
    rm -rf "$work"
    echo "fresh check: removed $work (HPCRL_FRESH_KEEP=1 keeps it)"
else
    echo "fresh check: kept $work for reading; remove it when done (about 8 GB)"
fi
exit "$status"
