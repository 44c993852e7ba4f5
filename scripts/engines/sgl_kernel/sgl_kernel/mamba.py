"""Names SGLang imports for its linear-attention models on CPU (srt/layers/attention/linear/
gdn_backend.py:183-184, kda_backend.py:38-39, kernels/gdn_triton.py:27-28). Those models need
the real kernels: calling one says so."""


def _missing(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.mamba.{name}: the torch-native sgl_kernel stand-in has no "
            "linear-attention kernels; serve a model with standard attention"
        )

    call.__name__ = name
    return call


chunk_gated_delta_rule_cpu = _missing("chunk_gated_delta_rule_cpu")
causal_conv1d_fn_cpu = _missing("causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _missing("causal_conv1d_update_cpu")
