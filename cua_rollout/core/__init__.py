"""Vocabulary: the error tree, the episode types, the screenshot, the run directory's names and
the small utilities (atomic files, asyncio helpers, HTTP helpers) every other layer uses. This
package imports nothing else of cua_rollout."""

__all__: list[str] = []
