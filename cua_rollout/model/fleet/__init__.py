"""The vLLM fleet behind ``run_model.py``, one job per module:

    cli          the serve / status / reload commands (run_model.py parses the arguments)
    supervisor   starts, restarts and health-checks the replicas; rolling reload
    control      the supervisor's control API (GET /status, POST /reload) and its client
    watch        --watch: rolls out each new checkpoint written to a directory
    checkpoints  resolving a checkpoint, its version, in-place reload compatibility
    devices      GPUs, CUDA_VISIBLE_DEVICES per replica, free ports
    launch       a replica's vLLM command line and environment
    processes    replica process groups: spawn, exit status, stop, stale-replica sweep
    replica_api  a replica's /health, /metrics and in-place weight reload
    state        endpoints.json and control.json: names, schema, atomic writes (stdlib only)

Importing the package imports none of them: the model client imports ``state`` alone.
"""

__all__: list[str] = []
