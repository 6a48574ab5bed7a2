"""OSWorld's own evaluator code (getters and metrics of ``desktop_env.evaluators``) in a
process of its own, so a score is the one OSWorld's leaderboard code gives.

This file runs under the interpreter of OSWorld's environment (``.venv-osworld``:
``desktop-env`` and what its evaluators import, pinned apart from the project's), never
inside the project's; it imports only the standard library, ``requests`` and
``desktop_env``. ``cua_rollout/evaluation/osworld_bridge.py`` starts it and keeps it warm:
importing OSWorld's metric modules costs seconds, paid once per worker.

    python osworld_worker.py          # PYTHONPATH=<an OSWorld checkout> to use its code

Protocol: one JSON object per line on stdin, one reply per line on the original stdout
(what OSWorld's code prints goes to stderr). The first reply, unasked, is the catalog:

    -> {"ready": true, "desktop_env": path, "metrics": [...], "getters": [...],
        "unavailable": {"metric:NAME"|"getter:NAME": why}, "import_s": s}
    <- {"id": 1, "op": "evaluate", "evaluator": {func, result, expected, options, conj},
        "desktop": {"url", "token", "chromium_port", "vlc_port"}, "cache_dir": dir}
    -> {"id": 1, "ok": true, "score": 0.5, "seconds": s}
     | {"id": 1, "ok": false, "kind": "unsupported"|"error"|"transport", "error": "...",
        "traceback": "..."}
     | {"id": 1, "ok": false, "kind": "bad_request", "error": "unknown op ..."}
    <- {"op": "metric", "name", "args", "options"}        one metric on given values
    <- {"op": "getter", "config", "desktop", "cache_dir"}  one getter on a desktop
    -> {"id", "ok": true, "value": ...}   (both for parity tests of our native functions)

How the code is loaded: ``desktop_env/evaluators/metrics/__init__.py`` imports every metric
module at once, so one missing library (easyocr needs torch and models from the internet)
would make all 111 metrics unusable. The worker builds the package skeleton itself and
imports each module on its own; the names a package exports are read from its
``__init__.py`` (its ``from .module import name`` lines) without running it, so a task's
``func`` resolves to the same function as ``getattr(metrics, func)`` in OSWorld. A module
whose import needs a library listed in ``_OPTIONAL`` gets a stand-in for it that raises on
use, and exactly the functions that use that name are reported unavailable.

The desktop is reached as OSWorld reaches it: an object with the attributes OSWorld's
getters read from its ``DesktopEnv`` (``controller``: OSWorld's own ``PythonController``,
``vm_ip``, ``server_port``, ``chromium_port``, ``vlc_port``, ``cache_dir``, ``vm_platform``).
Our desktop servers want a bearer token, which OSWorld's code does not send: requests to the
desktop server's origin get the ``Authorization`` header added (and only those).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DesktopView", "Registry", "evaluate", "is_transport", "main"]

# Libraries a metric module imports at its top but only some of its functions use; what
# using one of those functions here would need.
_OPTIONAL = {
    "easyocr": "easyocr (OCR on torch, with recognition models downloaded at first use)",
}

_PACKAGES = ("desktop_env", "desktop_env.evaluators", "desktop_env.evaluators.metrics",
             "desktop_env.evaluators.getters", "desktop_env.controllers")


class Unsupported(Exception):
    """The task names a function this environment cannot run."""


class _Missing(types.ModuleType):
    """Stand-in for an optional library that is not installed: importing it works (the
    module that names it loads), using it raises ``Unsupported`` naming it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__file__ = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise Unsupported(f"needs {_OPTIONAL[self.__name__]}, not installed in the OSWorld "
                          "evaluator environment")


# --------------------------------------------------------------------------- loading


def _package_dir() -> Path:
    spec = importlib.util.find_spec("desktop_env")  # finds, does not run, the package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("osworld_worker: no desktop_env package (pip install desktop-env, "
                         "or put an OSWorld checkout on PYTHONPATH)")
    return Path(next(iter(spec.submodule_search_locations)))


def _skeleton(root: Path) -> None:
    """The packages as empty modules with their paths: importing a submodule then runs that
    submodule (and what it imports), not the package's ``__init__``."""
    for name in _PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        module.__package__ = name
        sys.modules[name] = module


def _exports(init: Path) -> dict[str, tuple[str, str]]:
    """``name -> (module, attribute)`` of a package from its ``from .module import name``
    lines; names it defines itself map to ``("", name)``."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = ("", node.name)
    return out


def _uses(source: Path, names: set[str]) -> dict[str, set[str]]:
    """For each top-level function of a module: which of ``names`` it refers to."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & names
            if used:
                out[node.name] = used
    return out


class Registry:
    """OSWorld's metrics and getters by the names task files use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.functions: dict[str, Any] = {}  # "metric:NAME" / "getter:NAME" -> callable
        self.unavailable: dict[str, str] = {}
        self._modules: dict[str, types.ModuleType | str] = {}
        for kind, package in (("metric", "metrics"), ("getter", "getters")):
            base = root / "evaluators" / package
            for name, (module, attr) in _exports(base / "__init__.py").items():
                key = f"{kind}:{name[4:] if kind == 'getter' and name.startswith('get_') else name}"
                if not module:  # defined in __init__ (metrics.infeasible): never called
                    self.functions[key] = None
                    continue
                loaded = self._module(f"desktop_env.evaluators.{package}.{module}")
                if isinstance(loaded, str):
                    self.unavailable[key] = loaded
                    continue
                function = getattr(loaded, attr, None)
                if function is None:
                    self.unavailable[key] = f"{package}/{module}.py has no {attr}"
                    continue
                stood_in = {n for n, m in vars(loaded).items() if isinstance(m, _Missing)}
                needs = _uses(Path(loaded.__file__), stood_in).get(attr) if stood_in else None
                if needs:
                    self.unavailable[key] = "needs " + ", ".join(_OPTIONAL[n] for n in
                                                                 sorted(needs))
                self.functions[key] = function

    def _module(self, name: str) -> types.ModuleType | str:
        """The module, or why it cannot be imported."""
        if name not in self._modules:
            self._modules[name] = self._import(name)
        return self._modules[name]

    @staticmethod
    def _import(name: str) -> types.ModuleType | str:
        for _ in range(len(_OPTIONAL) + 1):
            try:
                return importlib.import_module(name)
            except ModuleNotFoundError as exc:
                missing = (exc.name or "").split(".")[0]
                if missing in _OPTIONAL and missing not in sys.modules:
                    sys.modules[missing] = _Missing(missing)
                    sys.modules.pop(name, None)
                    continue
                return (f"{name.rsplit('.', 1)[-1]}.py needs the Python module {exc.name!r}, "
                        "not installed in the OSWorld evaluator environment")
            except Exception as exc:  # a module that fails on import: name it, go on
                return f"{name.rsplit('.', 1)[-1]}.py fails to import: {type(exc).__name__}: {exc}"
        return f"{name}: too many missing optional libraries"

    def get(self, kind: str, name: Any) -> Any:
        key = f"{kind}:{name}"
        if not isinstance(name, str) or (key not in self.functions and key not in self.unavailable):
            raise Unsupported(f"OSWorld has no {kind} {name!r}")
        if key in self.unavailable:
            raise Unsupported(f"{kind} {name}: {self.unavailable[key]}")
        return self.functions[key]

    def catalog(self) -> dict[str, Any]:
        return {"metrics": sorted(k[7:] for k in self.functions if k.startswith("metric:")),
                "getters": sorted(k[7:] for k in self.functions if k.startswith("getter:")),
                "unavailable": dict(sorted(self.unavailable.items()))}


# --------------------------------------------------------------------------- the desktop


class DesktopView:
    """What OSWorld's getters read from its ``DesktopEnv``, for one desktop."""

    def __init__(self, desktop: dict[str, Any], cache_dir: str) -> None:
        from desktop_env.controllers.python import PythonController

        url = str(desktop["url"]).rstrip("/")
        parts = urlsplit(url)
        self.vm_ip = parts.hostname or "127.0.0.1"
        self.server_port = parts.port or (443 if parts.scheme == "https" else 80)
        self.chromium_port = int(desktop.get("chromium_port") or 9222)
        self.vlc_port = int(desktop.get("vlc_port") or 8080)
        self.cache_dir = cache_dir
        self.current_use_proxy = False
        self.enable_proxy = False
        self.controller = PythonController(vm_ip=self.vm_ip, server_port=self.server_port)
        self.controller.http_server = url  # a desktop behind a path prefix keeps it
        self._platform: str | None = None

    @property
    def vm_platform(self) -> str:
        if self._platform is None:
            self._platform = self.controller.get_vm_platform()
        return self._platform


_UNBOUND = object()
_AUTH: dict[str, str] = {}  # origin "scheme://host:port" -> "Bearer <token>"


def _authorize_requests() -> None:
    """Add the desktop's bearer token to requests OSWorld's code sends to its server."""
    import requests.sessions

    original = requests.sessions.Session.request

    def request(self: Any, method: str, url: Any, *args: Any, **kwargs: Any) -> Any:
        parts = urlsplit(str(url))
        header = _AUTH.get(f"{parts.scheme}://{parts.netloc}")
        if header:
            headers = dict(kwargs.get("headers") or {})
            headers.setdefault("Authorization", header)
            kwargs["headers"] = headers
        return original(self, method, url, *args, **kwargs)

    requests.sessions.Session.request = request  # type: ignore[method-assign]


def _offline_suffix_list() -> None:
    """URL metrics (``compare_urls``, via ``is_expected_tabs`` and others) split domains with
    tldextract, which on first use fetches the public suffix list from the internet, and
    falls back to the snapshot it ships after the fetch fails (a long traceback each worker;
    where DNS hangs instead of failing, seconds). Use the snapshot at once: the same answer
    offline, and the same on every run."""
    try:
        import tldextract.tldextract as tld
    except ImportError:  # an OSWorld checkout without it: its metric reports the import
        return
    tld.TLD_EXTRACTOR = tld.TLDExtract(suffix_list_urls=())


# --------------------------------------------------------------------------- scoring


def evaluate(registry: Registry, evaluator: dict[str, Any], env: DesktopView) -> float:
    """OSWorld's ``DesktopEnv.evaluate`` after its postconfig and infeasible/FAIL rules
    (the caller applies those): the same metric, getter and option resolution, and the same
    combination of a list of metrics (``and``: 0 at the first 0, else the mean; ``or``: 1 at
    the first 1, else the max; a result getter's ``FileNotFoundError`` scores 0)."""
    funcs = evaluator["func"]
    many = isinstance(funcs, list)
    metrics = [registry.get("metric", f) for f in funcs] if many else registry.get(
        "metric", funcs)
    conj = evaluator.get("conj", "and")

    def getters(key: str) -> Any:
        spec = evaluator.get(key)
        if spec and len(spec) > 0:
            if isinstance(spec, list):
                return [registry.get("getter", s["type"]) if s else None for s in spec]
            return registry.get("getter", spec["type"])
        return [None] * len(metrics) if many else None

    result_getter, expected_getter = getters("result"), getters("expected")
    if isinstance(evaluator.get("options", {}), list):
        options = [o if o else {} for o in evaluator["options"]]
    elif "options" in evaluator:
        options = evaluator["options"]
    else:
        options = [{}] * len(metrics) if many else {}

    if not many:
        try:
            result = result_getter(env, evaluator["result"])
        except FileNotFoundError:
            return 0.0
        if "expected" in evaluator and expected_getter and evaluator["expected"]:
            expected = expected_getter(env, evaluator["expected"])
            return float(metrics(result, expected, **options))
        return float(metrics(result, **options))

    if len(metrics) != len(result_getter):
        raise Unsupported("the number of metrics and result getters must be the same")
    if "expected" in evaluator and len(metrics) != len(expected_getter):
        raise Unsupported("the number of metrics and expected getters must be the same")
    scores: list[float] = []
    result: Any = _UNBOUND
    for index, metric in enumerate(metrics):
        try:
            result = result_getter[index](env, evaluator["result"][index])
        except FileNotFoundError:
            if conj == "and":
                return 0.0
            # OSWorld goes on with the previous metric's result (its variable keeps it),
            # or fails with UnboundLocalError on the first one.
            if result is _UNBOUND:
                raise RuntimeError("the first result getter raised FileNotFoundError under "
                                   "conj 'or' (OSWorld: UnboundLocalError)") from None
        if "expected" in evaluator and expected_getter and evaluator["expected"]:
            expected = expected_getter[index](env, evaluator["expected"][index])
            score = float(metric(result, expected, **options[index]))
        else:
            score = float(metric(result, **options[index]))
        if conj == "and" and score == 0.0:
            return 0.0
        if conj == "or" and score == 1.0:
            return 1.0
        scores.append(score)
    return sum(scores) / len(scores) if conj == "and" else max(scores)


def is_transport(exc: BaseException) -> bool:
    """The desktop (or its browser, its VLC) did not answer: a request that failed on the
    way, not a function that raised on what it read."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    module = type(exc).__module__
    return module.startswith(("requests.", "urllib3.", "playwright.")) and (
        "Connection" in type(exc).__name__ or "Timeout" in type(exc).__name__)


def _handle(registry: Registry, request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "catalog":
        return {"ok": True, **registry.catalog()}
    if op == "ping":
        return {"ok": True}
    if op == "metric":  # one metric on given arguments (parity checks, no desktop)
        try:
            metric = registry.get("metric", request["name"])
            value = metric(*request.get("args", []), **(request.get("options") or {}))
            return {"ok": True, "value": value}
        except Unsupported as exc:
            return {"ok": False, "kind": "unsupported", "error": str(exc)}
        except Exception as exc:
            return {"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}"}
    if op not in ("evaluate", "getter"):
        return {"ok": False, "kind": "bad_request", "error": f"unknown op {op!r}"}
    desktop = request["desktop"]
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(str(desktop["url"])))
    if desktop.get("token"):
        _AUTH[origin] = f"Bearer {desktop['token']}"
    started = time.monotonic()
    try:
        env = DesktopView(desktop, request["cache_dir"])
        if op == "getter":  # one getter (parity checks of the native getters)
            config = request["config"]
            value = registry.get("getter", config.get("type"))(env, config)
            return {"ok": True, "value": value}
        score = evaluate(registry, request["evaluator"], env)
    except Unsupported as exc:
        return {"ok": False, "kind": "unsupported", "error": str(exc)}
    except Exception as exc:
        return {"ok": False, "kind": "transport" if is_transport(exc) else "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=-8)}
    finally:
        _AUTH.pop(origin, None)
    return {"ok": True, "score": score, "seconds": round(time.monotonic() - started, 4)}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    # The protocol keeps the real stdout; whatever OSWorld's code prints goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="osworld_worker %(levelname)s %(name)s: %(message)s")
    # Some metrics turn on DEBUG output of their own (compare_pptx_files: hundreds of lines
    # per comparison, twice over); the runner's log keeps warnings and errors only.
    logging.disable(logging.DEBUG)
    warnings.filterwarnings("ignore", message="The `fitz` API is deprecated")  # pymupdf's
    started = time.monotonic()
    root = _package_dir()
    _skeleton(root)
    _authorize_requests()
    _offline_suffix_list()
    registry = Registry(root)
    ready = {"ready": True, "desktop_env": str(root), "python": sys.version.split()[0],
             "import_s": round(time.monotonic() - started, 2), **registry.catalog()}
    protocol.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = _handle(registry, request)
        except Exception as exc:  # a malformed request: answer it, keep serving
            request, reply = {}, {"ok": False, "kind": "error",
                                  "error": f"bad request: {type(exc).__name__}: {exc}"}
        reply["id"] = request.get("id") if isinstance(request, dict) else None
        protocol.write(json.dumps(reply, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
