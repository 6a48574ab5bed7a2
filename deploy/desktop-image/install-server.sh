#!/bin/sh
# How a desktop image installs its server, shared by the container image (Containerfile's RUN)
# and the VM test image (scripts/build_vm_image.sh, in the guest's tree): /opt/venv with
# Debian's site packages (for python3-pyatspi), the wheels of requirements.txt from a directory
# (no network), and the non-root user the server runs as, home /home/user, as OSWorld's; where
# the image has sudo (the osworld profile), that user's password is OSWorld's ("password") and
# it may sudo, as tasks do with `echo password | sudo -S ...`.
#
#   sh install-server.sh WHEELS_DIR REQUIREMENTS_TXT UID
set -eu
python3 -m venv --system-site-packages /opt/venv
/opt/venv/bin/pip install --no-cache-dir --no-index --find-links "$1" -r "$2"
useradd --create-home --uid "$3" --shell /bin/bash user
if command -v sudo >/dev/null 2>&1; then
    echo 'user:password' | chpasswd
    echo 'user ALL=(ALL:ALL) ALL' > /etc/sudoers.d/user
    chmod 0440 /etc/sudoers.d/user
fi
