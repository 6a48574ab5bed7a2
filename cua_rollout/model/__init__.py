"""The model side: the OpenAI chat wire models, the client that routes generations over the
vLLM endpoints, their /metrics, the vision geometry of Qwen-VL image processors, and the
vLLM fleet (``fleet/``) behind ``cua-rollout model``."""

__all__: list[str] = []
