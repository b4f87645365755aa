"""Terminal environment (Harbor layout): the agent works in a copy of the task's environment; the
task's own test script scores the final state.

Local executor: a copy of `environment/` is mounted at /app (Harbor images' working directory) and
every command starts there; an approximation of the task's image that holds for tasks whose
environment is plain files (the embedded suite). Docker executor: the task's image (envs/images.py),
every command (the verifier's too) run in its Dockerfile's WORKDIR. The tests are invisible during
the episode and mounted only when the reward is computed:
  harbor  `bash /tests/test.sh` with tests/ at /tests (read-only) and a fresh host folder at
          /logs/verifier (read-write); the reward is reward.txt or reward.json there
  tb1     `bash /task/<run-tests.sh>` with TEST_DIR=/tests; 1.0 when pytest reports at least one test
          and every test passed (terminal-bench 1.x semantics)
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
import shutil
import tempfile
from pathlib import Path

from tsrl_cli.agent.loop import RewardResult
from tsrl_cli.agent.rewards import parse_pytest_log, read_reward_file
from tsrl_cli.envs.base import SandboxEnv
from tsrl_cli.envs.images import image_workdir
from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits, Mount, open_sandbox
from tsrl_cli.sandbox.base import remove_tree

DEFAULT_VERIFIER_TIMEOUT_S = 120.0
APP = "/app"


class TerminalEnv(SandboxEnv):
    def __init__(self, task, dataset_dir: str | Path, *, executor: str = "local", limits: Limits | None = None,
                 allow_unisolated: bool = False, verifier_timeout_s: float | None = None, image: str | None = None):
        """image: the docker executor's image (envs/images.task_image), default the task's prebuilt one."""
        super().__init__(executor=executor, limits=limits, allow_unisolated=allow_unisolated)
        self.task, self.task_id, self.image = task, task.task_id, image or task.docker_image
        self.task_dir = Path(dataset_dir) / task.task_dir
        self.start_path = self.task_dir / task.environment_dir
        self.workdir = APP if executor == "local" else image_workdir(self.start_path)
        self.instruction = task.instruction
        self.verifier_timeout_s = verifier_timeout_s or task.verifier_timeout_s or DEFAULT_VERIFIER_TIMEOUT_S
        self._app: Path | None = None  # host copy of environment/, mounted at /app (local executor)

    async def start(self) -> None:
        if self.executor != "local":
            return await super().start()
        self._app = Path(tempfile.mkdtemp(prefix="tsrl-app-"))
        await asyncio.to_thread(shutil.copytree, self.start_path, self._app, dirs_exist_ok=True)
        self.sandbox = await asyncio.to_thread(
            open_sandbox, None, executor="local", limits=self.limits, allow_unisolated=self.allow_unisolated,
            mounts=[Mount(str(self._app), APP, read_only=False, own_tree=True)],
        )

    def exec(self, command: str, timeout_s: float, mounts=None):
        return super().exec(f"cd {self.workdir} && {command}", timeout_s, mounts)

    async def close(self) -> None:
        await super().close()
        if self._app is not None:
            await asyncio.to_thread(remove_tree, self._app)
            self._app = None

    async def reward(self) -> RewardResult:
        if self.sandbox is None:
            return RewardResult(0.0, "the sandbox never started")
        logs = Path(tempfile.mkdtemp(prefix="tsrl-verifier-"))
        try:
            return await asyncio.to_thread(self._verify, logs)
        except Exception as e:  # noqa: BLE001 - the verifier's failure is a reward of 0, with its reason
            return RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}")
        finally:
            remove_tree(logs)

    def oracle_command(self) -> str:
        """One bash command that plays the task's reference solution where the agent works (Harbor's
        `oracle` agent): the solution's files written to /solution (a fresh temporary folder where
        /solution cannot be made), then `bash solve.sh` (TB 1.x: the task's solution.sh). The same
        text is the oracle's model turn in training (rollout.agent oracle)."""
        if not self.task.solution_script or not self.task.solution_script.endswith(".sh"):
            raise UsageError(f"task {self.task_id}: no solution script to play (oracle agent)")
        sol = self.task_dir / self.task.solution_script
        # Harbor's solution/ folder travels whole; a TB 1.x solution.sh sits beside the tests: it travels alone
        files = sorted(p for p in sol.parent.rglob("*") if p.is_file()) if sol.parent.name == "solution" else [sol]
        lines = ['D=/solution; { mkdir -p "$D" && [ -w "$D" ]; } 2>/dev/null || D=$(mktemp -d)']
        for f in files:
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                raise UsageError(f"task {self.task_id}: {f} is not text; the oracle writes solution files "
                                 "as here-documents") from None
            rel = f.relative_to(sol.parent).as_posix()
            tag = "TSRL_ORACLE_" + hashlib.sha256(text.encode()).hexdigest()[:12]
            if "/" in rel:
                lines.append(f'mkdir -p "$D"/{shlex.quote(str(Path(rel).parent))}')
            lines.append(f"cat > \"$D\"/{shlex.quote(rel)} <<'{tag}'\n{text.rstrip(chr(10))}\n{tag}")
        lines.append(f'bash "$D"/{shlex.quote(sol.name)}')
        return "\n".join(lines)

    async def play_oracle(self) -> None:
        """Run oracle_command() where the agent works; RuntimeError when the solution fails."""
        res = await asyncio.to_thread(self.exec, self.oracle_command(),
                                      self.task.agent_timeout_s or DEFAULT_VERIFIER_TIMEOUT_S)
        if res.exit_code != 0 or res.limit:
            raise RuntimeError(f"task {self.task_id}: the solution failed (exit {res.exit_code}, limit {res.limit}): "
                               f"{res.stderr.strip()[-200:]}")

    def _verify(self, logs: Path) -> RewardResult:
        tests = self.task_dir / "tests"
        mounts = [Mount(str(tests), "/tests", True)] if tests.is_dir() else []
        if self.task.format == "tb1":
            mounts.append(Mount(str(self.task_dir), "/task", True))
            cmd = f"TEST_DIR=/tests bash /task/{shlex.quote(self.task.test_script)}"
        else:
            mounts.append(Mount(str(logs), "/logs/verifier", False))
            cmd = f"bash /tests/{shlex.quote(Path(self.task.test_script).name)}"
        res = self.exec(cmd, self.verifier_timeout_s, mounts=mounts)
        if res.limit:
            return RewardResult(0.0, f"verifier stopped by the {res.limit} limit", {"exit_code": res.exit_code})
        if self.task.format == "tb1":
            status = parse_pytest_log(res.stdout)
            passed = bool(status) and all(s in ("PASSED", "XFAIL") for s in status.values())
            return RewardResult(float(passed), f"{sum(s == 'PASSED' for s in status.values())}/{len(status)} "
                                               "tests passed")
        return read_reward_file(logs)
