"""Agents: what turns an observation and a history into a model request, and a generation
into a decision. ``uitars/`` is the UI-TARS agent (prompt, parser, code generation, grammar);
``scripted_policy`` the demo's scripted UI-TARS model behind an OpenAI-compatible server."""

__all__: list[str] = []
