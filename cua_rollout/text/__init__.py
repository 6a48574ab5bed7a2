"""Text environments: ``math``, ``py``, ``rag`` and ``web`` episodes without a desktop, the
tools their agents call, and the answer metrics that score them (``metrics.py``,
docs/text_metrics.md)."""

__all__: list[str] = []
