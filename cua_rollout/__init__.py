"""cua-rollout: a rollout service for computer-use (GUI) agents, as one layered package.

    core        vocabulary: errors, episode types, screenshots, the run directory's names
    config      the one YAML schema
    model       the OpenAI wire models, the model client, the vLLM fleet
    desktop     the program inside a desktop (standalone: imports nothing else of the package)
    training    the trainer's index (claim, ack, export)
    results     reading runs
    envs        environments: contract, desktop client, setup steps, providers
    text        text environments and their tools
    evaluation  scoring by OSWorld's rules
    agents      what turns observations into requests and generations into actions
    runtime     the episode loop, runners, coordinator, storage, desktop pool, task loader,
                and Rollout, the Python API (runtime/driver.py)
    cli         the ``cua-rollout`` command

Each layer imports only the layers listed above it (model and desktop, training and results,
text and evaluation side by side; docs/architecture.md; checked by import-linter in
tests/unit/test_layout.py). Importing this package imports nothing else.
"""

__all__: list[str] = []
