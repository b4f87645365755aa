"""What every task environment shares: one sandbox per trajectory and the agent's bash tool."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tsrl_cli.agent.loop import RewardResult, ToolResult
from tsrl_cli.sandbox import Limits, open_sandbox


class SandboxEnv:
    """Subclasses set `task_id`, `instruction`, `start_path`, `image` and implement `reward()`."""

    task_id: str
    instruction: str
    start_path: Path | None
    image: str | None

    def __init__(self, *, executor: str = "local", limits: Limits | None = None, allow_unisolated: bool = False):
        self.executor, self.limits, self.allow_unisolated = executor, limits, allow_unisolated
        self.sandbox = None

    async def start(self) -> None:
        self.sandbox = await asyncio.to_thread(
            open_sandbox, self.start_path, executor=self.executor, image=self.image, limits=self.limits,
            allow_unisolated=self.allow_unisolated,
        )

    def exec(self, command: str, timeout_s: float, mounts=None):
        """One command exactly as the agent's bash tool runs it -> the sandbox's ExecResult."""
        return self.sandbox.run(command, timeout_s, mounts=mounts)

    async def run(self, command: str, timeout_s: float) -> ToolResult:
        res = await asyncio.to_thread(self.exec, command, timeout_s)
        out = res.stdout + (("\n" if res.stdout and res.stderr else "") + res.stderr if res.stderr else "")
        return ToolResult(out, res.exit_code, res.duration_s, res.limit)

    async def reward(self) -> RewardResult:
        raise NotImplementedError

    async def close(self) -> None:
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
