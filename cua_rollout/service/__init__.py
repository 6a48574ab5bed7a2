"""The desktop service (``cua-rollout desktops serve``): a run's desktop pool behind an HTTP
API (``cua_rollout/envs/service_protocol.py``) for tenants outside a run: leases with
heartbeats and expiry, per-tenant quotas, task setup, actions, observations and OSWorld
scoring, and the desktops' own traffic direct (a per-lease token) or relayed.

    failures.py   Refusal: an error as a value (its code and reason), an HTTP status at the edge
    tenants.py    bearer tokens -> tenants, quotas with a fair wait, the address allow-list
    leases.py     the lease table: env ids of this boot, expiry, 404 / 410 / 403 by id
    session.py    one lease's desktop: setup, actions by kind, observations, scoring
    core.py       DesktopService: the pool, the table and the sessions together
    relay.py      a lease's desktop paths streamed to its desktop
    metrics.py    the Prometheus figures
    app.py        the FastAPI app: thin routes, auth, body limit, errors
    serve.py      start (pool, app, uvicorn) and a clean stop on SIGTERM / SIGINT
"""

__all__: list[str] = []
