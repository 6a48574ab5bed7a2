"""The program that runs inside a desktop: its X session, window manager and HTTP server.

Standalone: this package is what a desktop image carries, so it imports nothing of the
controller; the controller imports ``cua_rollout.desktop.protocol`` (and launches
``cua_rollout.desktop.server``).
"""

__all__: list[str] = []
