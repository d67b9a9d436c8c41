"""Analysis the tools share, below them all (bench, aot, diagnostics, tformer-estimate import it; it imports no tool).

- `flops`: the model's FLOP formula (6 * N_matmul * T plus the attention term, remat's recompute, LoRA fine-tuning).
- `hlo`: the compiled HLO reader (matmul, convolution and kernel FLOPs; collectives by kind and bytes).
- `estimate`: the memory and FLOP estimator, a pure function of the config (nothing compiled).
"""
