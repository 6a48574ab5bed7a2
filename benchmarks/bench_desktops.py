"""Start and reset times and memory of desktops, by provider, at several pool sizes.

    python benchmarks/bench_desktops.py --provider container --sizes 1 4 16 [--resets 3]
    python benchmarks/bench_desktops.py --provider local --sizes 1 4
    python benchmarks/bench_desktops.py --provider kubernetes --sizes 1 4

``kubernetes`` runs against the Kubernetes API test server (``tests.doubles.kube_api``) whose
kubelet starts each pod as a container of the desktop image on this machine: start = create
through the API until the pod is Ready (readiness probe) and its server answers.

For each size N: N desktops started at once through the provider (start = the call until the
desktop's server answers), then ``--resets`` in-place resets of each, one desktop at a time
(what a reset costs without contention) and all at once; memory per desktop from the engine
(``podman stats``: the container's cgroup) or the session's processes (local). Prints a table
and, with ``--json``, writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.providers import make_provider


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def _memory_mib(provider: Any, desktops: list[Any], kubelet: Any = None) -> list[float]:
    if hasattr(provider, "container_id") or kubelet is not None:
        ids = [provider.container_id(d.id) if kubelet is None
               else kubelet.container_of(provider.namespace, d.id) for d in desktops]
        out = subprocess.run(["podman", "stats", "--no-stream", "--format",
                              "{{.ID}} {{.MemUsage}}", *ids],
                             capture_output=True, text=True, check=True).stdout
        sizes = []
        for line in out.splitlines():
            used = line.split()[1]
            number = float("".join(c for c in used if c.isdigit() or c == "."))
            unit = used.lstrip("0123456789.").lower()
            sizes.append(number * {"kb": 1 / 1024, "mb": 1, "gb": 1024}.get(unit[:2], 1))
        return sizes
    import psutil

    sizes = []
    for d in desktops:
        session = provider._sessions[d.id]  # the benchmark reads the provider it made
        rss = 0
        for pid in session.core_pids():
            try:
                proc = psutil.Process(pid)
                rss += proc.memory_info().rss
                rss += sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                continue
        sizes.append(rss / 2**20)
    return sizes


async def _one_size(cfg: DesktopsConfig, n: int, resets: int, kubelet: Any = None
                    ) -> dict[str, Any]:
    provider = make_provider(cfg)
    t0 = time.monotonic()
    results = await asyncio.gather(*(provider.start(i) for i in range(n)),
                                   return_exceptions=True)
    desktops = [d for d in results if not isinstance(d, BaseException)]
    failed = [repr(e) for e in results if isinstance(e, BaseException)]
    all_started_s = time.monotonic() - t0
    try:
        starts = [d.info.get("start_s") or all_started_s for d in desktops]
        alone, together = [], []
        for _ in range(resets):
            for d in desktops:
                t = time.monotonic()
                await provider.reset(d)
                alone.append(time.monotonic() - t)
            t = time.monotonic()
            await asyncio.gather(*(provider.reset(d) for d in desktops))
            together.append(time.monotonic() - t)
        memory = await asyncio.to_thread(_memory_mib, provider, desktops, kubelet)
    finally:
        await asyncio.gather(*(provider.stop(d) for d in desktops), return_exceptions=True)
        await provider.close()
    return {"desktops": n, "started": len(desktops), "failed": failed,
            "start_s": _stats(starts), "all_started_s": round(all_started_s, 3),
            "reset_s": _stats(alone) if alone else None,
            "reset_all_at_once_s": _stats(together) if together else None,
            "memory_mib": _stats(memory) if memory else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=["container", "local", "kubernetes"],
                        default="container")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--resets", type=int, default=3)
    parser.add_argument("--image", default=None, help="container: the desktop image")
    parser.add_argument("--screen", default="1280x720")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.screen.split("x"))
    container = {"start_timeout_s": 180}
    if args.image:
        container["image"] = args.image
    rows = []
    with contextlib.ExitStack() as stack:
        k8s, token_env, kubelet = {}, None, None
        if args.provider == "kubernetes":
            k8s, token_env, kubelet = _kubernetes(stack, args.image or container.get("image"))
        for n in args.sizes:
            cfg = DesktopsConfig(provider=args.provider, count=n, screen_width=width,
                                 screen_height=height, reset_timeout_s=120,
                                 container=container, kubernetes=k8s, token_env=token_env,
                                 local={"state_dir": Path("/tmp/bench-desktops"),
                                        "start_timeout_s": 180})
            rows.append(_report(args.provider, n,
                                asyncio.run(_one_size(cfg, n, args.resets, kubelet))))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _kubernetes(stack: contextlib.ExitStack, image: str | None
                ) -> tuple[dict[str, Any], str, Any]:
    """The API test server with a kubelet of real containers, for the whole benchmark."""
    import os
    import secrets
    import tempfile

    from tests.doubles.kube_api import KubeAPIServer
    from tests.doubles.kubelet import ContainerKubelet

    token_env = "CUA_BENCH_DESKTOP_TOKEN"
    os.environ[token_env] = secrets.token_hex(16)
    kubelet = ContainerKubelet({("desk-token", "token"): os.environ[token_env]})
    stack.callback(kubelet.close)
    server = KubeAPIServer(kubelet=kubelet)
    server.start()
    stack.callback(server.stop)
    where = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-k8s-")))
    k8s = {"namespace": "bench", "image": image or "localhost/cua-desktop:demo",
           "token_secret": "desk-token", "startup_timeout_s": 300,
           "kubeconfig": str(server.kubeconfig(where / "kubeconfig", "bench"))}
    return k8s, token_env, kubelet


def _report(provider: str, n: int, row: dict[str, Any]) -> dict[str, Any]:
    print(f"{provider} x{n}: started {row['started']}/{n} (all in "
              f"{row['all_started_s']} s); start s {row['start_s']}; reset s alone "
              f"{row['reset_s']}, all at once {row['reset_all_at_once_s']}; memory MiB "
              f"{row['memory_mib']}" + (f"; failed: {row['failed']}" if row["failed"] else ""),
              flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
