"""Terminal task directories -> TerminalTask: Harbor format (SETA-Env, Terminal-Bench 2.x) and TB 1.x.

Harbor (harbor's task format, `harbor run`): instruction.md, task.toml ([metadata], [agent]
timeout_sec, [verifier] timeout_sec, [environment] build_timeout_sec / docker_image / cpus /
memory_mb / ...), environment/ (Dockerfile or docker-compose.yaml), tests/test.sh (writes
/logs/verifier/reward.txt or reward.json), solution/solve.sh.
Terminal-Bench 1.x: task.yaml (instruction, difficulty, max_agent_timeout_sec = 360,
max_test_timeout_sec = 60, parser_name = pytest, ...), Dockerfile or docker-compose.yaml at the
root, run-tests.sh, tests/, solution.sh; a task passes when every parsed test passes.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from tsrl_cli.datasets.records import FieldError, TerminalTask
from tsrl_cli.files import tree_sha256

SETA_HUB_ID = "camel-ai/SETA-Env"
TASK_FILES = ("task.toml", "task.yaml", "instruction.md")  # any of these marks a task directory
_COMPOSE = ("Dockerfile", "docker-compose.yaml", "docker-compose.yml")


def find_task_dirs(root: Path) -> list[Path]:
    """Task directories under root (root itself if it is one), sorted; nothing below a task dir is searched."""
    if any((root / f).is_file() for f in TASK_FILES):
        return [root]
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found += find_task_dirs(d)
    return found


def read_task_dir(path: Path, *, source: str, split: str, rel: str) -> TerminalTask:
    """One task directory; `rel` (its path under the input root) goes to meta["path"]."""
    if (path / "task.toml").is_file():
        task = _read_harbor(path, source, split)
    elif (path / "task.yaml").is_file():
        task = _read_tb1(path, source, split)
    else:
        raise FieldError("task.toml", "missing (a Harbor task needs task.toml; a Terminal-Bench 1.x task, task.yaml)")
    task.meta["path"] = rel
    return task


def _read_harbor(path: Path, source: str, split: str) -> TerminalTask:
    try:
        cfg = tomllib.loads((path / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FieldError("task.toml", f"not valid TOML ({e})") from None
    instruction = _read_text(path, "instruction.md")
    if not (path / "environment").is_dir():
        raise FieldError("environment/", "missing")
    if not (path / "tests" / "test.sh").is_file():
        raise FieldError("tests/test.sh", "missing")
    env = _table(cfg, "environment")
    meta = {"schema_version": str(cfg.get("version", ""))} if "version" in cfg else {}
    meta.update({k: v for k, v in _table(cfg, "metadata").items() if isinstance(v, str | int | float | bool | list)})
    meta.update({k: env[k] for k in ("cpus", "memory_mb", "storage_mb", "gpus", "allow_internet") if k in env})
    image = env.get("docker_image")
    if image is not None and not isinstance(image, str):
        raise FieldError("task.toml [environment] docker_image", "expected a string")
    solution = "solution/solve.sh" if (path / "solution" / "solve.sh").is_file() else None
    return TerminalTask(
        task_id=path.name, source=source, split=split, format="harbor", instruction=instruction,
        task_dir=f"tasks/{path.name}", environment_dir="environment", test_script="tests/test.sh",
        solution_script=solution, docker_image=image or None,
        agent_timeout_s=_seconds(_table(cfg, "agent"), "agent", "timeout_sec", None),
        verifier_timeout_s=_seconds(_table(cfg, "verifier"), "verifier", "timeout_sec", 600.0),
        build_timeout_s=_seconds(env, "environment", "build_timeout_sec", 600.0),
        reward_mode="reward_file", dir_sha256=tree_sha256(path), meta=meta,
    )


def _read_tb1(path: Path, source: str, split: str) -> TerminalTask:
    try:
        cfg = yaml.safe_load((path / "task.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise FieldError("task.yaml", f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise FieldError("task.yaml", "expected a mapping")
    instruction = cfg.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise FieldError("task.yaml instruction", "missing or empty")
    if cfg.get("difficulty") not in ("easy", "medium", "hard"):
        raise FieldError("task.yaml difficulty", f"expected easy, medium or hard, got {cfg.get('difficulty')!r}")
    if not any((path / f).is_file() for f in _COMPOSE):
        raise FieldError("Dockerfile", "missing (neither Dockerfile nor docker-compose.yaml)")
    # the tb harness runs run-tests.sh when present, else pytest on tests/test_outputs.py
    test_script = next((s for s in ("run-tests.sh", "tests/test_outputs.py") if (path / s).is_file()), None)
    if test_script is None:
        raise FieldError("run-tests.sh", "missing (and no tests/test_outputs.py)")
    meta = {k: cfg[k] for k in ("difficulty", "category", "tags", "parser_name", "author_name") if k in cfg}
    solution = next((s for s in ("solution.sh", "solution.yaml") if (path / s).is_file()), None)
    return TerminalTask(
        task_id=path.name, source=source, split=split, format="tb1", instruction=instruction,
        task_dir=f"tasks/{path.name}", environment_dir=".", test_script=test_script, solution_script=solution,
        docker_image=None,
        agent_timeout_s=_seconds(cfg, "task.yaml", "max_agent_timeout_sec", 360.0),
        verifier_timeout_s=_seconds(cfg, "task.yaml", "max_test_timeout_sec", 60.0),
        build_timeout_s=None, reward_mode="all_tests_pass", dir_sha256=tree_sha256(path), meta=meta,
    )


def _read_text(path: Path, name: str) -> str:
    p = path / name
    if not p.is_file():
        raise FieldError(name, "missing")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise FieldError(name, "not UTF-8 text") from None
    if not text.strip():
        raise FieldError(name, "empty")
    return text


def _table(cfg: dict, name: str) -> dict:
    t = cfg.get(name, {})
    if not isinstance(t, dict):
        raise FieldError(f"task.toml [{name}]", "expected a table")
    return t


def _seconds(table: dict, where: str, key: str, default: float | None) -> float | None:
    v = table.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        raise FieldError(f"{where} {key}" if where.endswith(".yaml") else f"task.toml [{where}] {key}",
                         f"expected a positive number of seconds, got {v!r}")
    return float(v)
