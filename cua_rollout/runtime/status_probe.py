"""The Kubernetes probe of a driver's ``/healthz`` (deploy/kubernetes/rayjob.yaml):
``python -m cua_rollout.runtime.status_probe http://127.0.0.1:8270`` exits 0 when the driver
is healthy or none listens (the Ray head outlives its job's driver), 1 when it answers 503
or nothing in time. Standard library only: the kubelet runs it every period."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

__all__ = ["probe"]


def probe(url: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    """A probe of ``url``'s ``/healthz``: ok on 200, and when nothing listens (no driver runs
    in this pod now: before the job's driver starts, after it ends: the pod is not at fault);
    not ok on 503 (the reason) or no answer in ``timeout_s`` (a hung driver)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout_s) as reply:
            return True, reply.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code}: {exc.read().decode('utf-8', 'replace')[:300]}"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return True, "no driver is serving here"
        return False, str(exc.reason)
    except TimeoutError:
        return False, f"no answer in {timeout_s:g} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cua_rollout.runtime.status_probe",
                                description="Probe a driver's /healthz (exit 0: ok or no "
                                            "driver listening; 1: unhealthy).")
    p.add_argument("url", help="the driver's status URL, e.g. http://127.0.0.1:8270")
    p.add_argument("--timeout-s", type=float, default=5.0)
    args = p.parse_args(argv)
    ok, what = probe(args.url, args.timeout_s)
    print(what, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
