"""QEMU virtual machines as desktops: their launcher, control and host-side gate."""

__all__: list[str] = []
