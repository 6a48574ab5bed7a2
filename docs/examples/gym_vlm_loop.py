"""A vision-language model driving ``CuaDesktopEnv`` in a plain loop: a desktop leased from
the desktop service, the model's UI-TARS replies as actions (the service parses them), the
task's reward at the end.

    cua-rollout desktops serve --config service.yaml &    # docs/desktop_service.md
    python run_model.py serve --config configs/demo_vlm.yaml &   # a model (the tiny VLM)
    CUA_SERVICE_TOKEN=... python docs/examples/gym_vlm_loop.py \\
        --service http://127.0.0.1:8790 --model-url http://127.0.0.1:8150 --model tiny-vlm \\
        --task tasks/demo/examples/terminal/terminal-hello-file.json

Prints one line per step and the episode's reward; ``run_episode`` returns them for a
caller (the integration test). Replace the model call with your policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from cua_rollout.agents.uitars import action_regex
from cua_rollout.agents.uitars.prompt import Turn, build_messages
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.gym import CuaDesktopEnv


def ask_model(model_url: str, model: str, messages: list[dict[str, Any]], *,
              regex: str | None, max_tokens: int = 300, timeout_s: float = 300.0) -> str:
    """One chat completion (an OpenAI-compatible server: vLLM); ``regex`` holds the reply to
    the UI-TARS action grammar (vLLM's structured outputs)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 1.0}
    if regex is not None:
        body["structured_outputs"] = {"regex": regex}
    response = httpx.post(model_url.rstrip("/") + "/v1/chat/completions", json=body,
                          timeout=timeout_s)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


def run_episode(env: CuaDesktopEnv, task: dict[str, Any], *, model_url: str, model: str,
                constrain: bool = True, history_images: int = 5) -> dict[str, Any]:
    """One episode of ``task``: reset, then model -> step until terminated or truncated."""
    _, info = env.reset(options={"task": task})
    width, height = info["screen"]
    regex = action_regex(width, height) if constrain else None
    history: list[Turn] = []
    steps: list[dict[str, Any]] = []
    current = Screenshot(info["screenshot_png"])
    print(f"leased {info['env_id']} for {info['task_id']} (setup {info['setup_s']:.1f} s)",
          file=sys.stderr)
    while True:
        messages = build_messages(task["instruction"], history, current,
                                  history_images=history_images)
        reply = ask_model(model_url, model, messages, regex=regex)
        _, reward, terminated, truncated, info = env.step(reply)
        steps.append({"reply": reply, "executed": info["executed"],
                      "parse_error": info["parse_error"], "terminal": info["terminal"],
                      "returncode": info["returncode"]})
        if info["parse_error"]:
            what = f"parse error: {info['parse_error']}"
        else:
            what = info["terminal"] or f"ran, returncode {info['returncode']}"
        print(f"step {info['step']}: {reply.splitlines()[-1][:80]!r} -> {what}",
              file=sys.stderr)
        history.append(Turn(current, reply))
        current = Screenshot(info["screenshot_png"])
        if terminated or truncated:
            return {"task_id": task["id"], "reward": reward, "terminated": terminated,
                    "truncated": truncated, "evaluated": info.get("evaluated"),
                    "evaluation_error": info.get("evaluation_error"), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", required=True, help="the desktop service's URL")
    parser.add_argument("--token-env", default="CUA_SERVICE_TOKEN",
                        help="environment variable holding the tenant's token")
    parser.add_argument("--model-url", required=True, help="an OpenAI-compatible server")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--task", required=True, type=Path, help="an OSWorld task file")
    parser.add_argument("--screen", default="1280x720", help="the desktops' WxH")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--no-constrain", action="store_true",
                        help="do not hold replies to the action grammar")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.screen.split("x"))
    task = json.loads(args.task.read_text())
    env = CuaDesktopEnv(args.service, token_env=args.token_env, action_kind="uitars",
                        screen=(width, height), max_steps=args.max_steps,
                        label="gym_vlm_loop")
    try:
        result = run_episode(env, task, model_url=args.model_url, model=args.model,
                             constrain=not args.no_constrain)
    finally:
        env.close()
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
