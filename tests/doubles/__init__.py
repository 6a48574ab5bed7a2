"""Test doubles that speak the real wire protocols on real loopback ports (``fake_openai``: an
OpenAI/vLLM chat server with scripted faults) or meet the real contracts, used by the tests
AND the benchmarks; they live here because benchmarks must never import from ``tests/``."""

__all__: list[str] = []
