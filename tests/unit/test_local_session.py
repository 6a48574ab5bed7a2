"""Pure parts of the local desktop launcher."""

from __future__ import annotations

import os
from pathlib import Path

from cua_rollout.envs.local_session import office_pipe


def test_libreoffices_socket_name_is_derived_as_libreoffice_derives_it():
    # Observed: LibreOffice 7.4 started with this HOME created exactly this socket in /tmp,
    # which a reset that kills it must remove (LibreOffice leaves it behind).
    home = Path("/tmp/rp-glzipbkr/local-31280-0/home")
    assert office_pipe(home) == Path(
        f"/tmp/OSL_PIPE_{os.getuid()}_SingleOfficeIPC_1bf9f324cd616be8db86f36aacc2db8")
    assert office_pipe(home.parent / "other") != office_pipe(home)
