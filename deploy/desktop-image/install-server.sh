#!/bin/sh
# How a desktop image installs its server, shared by the container image (Containerfile's RUN)
# and the VM test image (scripts/build_vm_image.sh, in the guest's tree): /opt/venv with
# Debian's site packages (for python3-pyatspi), the wheels of requirements.txt from a directory
# (no network), and the non-root user the server runs as, home /home/user, as OSWorld's.
#
#   sh install-server.sh WHEELS_DIR REQUIREMENTS_TXT UID
set -eu
python3 -m venv --system-site-packages /opt/venv
/opt/venv/bin/pip install --no-cache-dir --no-index --find-links "$1" -r "$2"
useradd --create-home --uid "$3" --shell /bin/bash user
