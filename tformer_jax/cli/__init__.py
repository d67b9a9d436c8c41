"""The command lines, one module each; every one is a console command once the package is installed
(pyproject.toml [project.scripts]) and a thin `python scripts/<name>.py` in a checkout:

  tformer-train           train.py            train (and resume) from a config file
  tformer-generate        generate.py         sample from a workdir, an HF directory or random weights
  tformer-serve           serve.py            an OpenAI-compatible HTTP server (continuous batching)
  tformer-eval            eval.py             loss / perplexity / bits per byte / accuracy on a corpus
  tformer-convert         convert.py          HF directory <-> training workdir
  tformer-prepare         prepare.py          text sources -> sharded token files
  tformer-ablate          ablate.py           the loss with one component switched off
  tformer-estimate        estimate_memory.py  memory of a config, without running it
  tformer-extrapolate     extrapolate.py      loss beyond the trained length, per position scheme
  tformer-attention-map   attention_map.py    attention weights of a text, as images
  tformer-launch-local    launch_local.py     a multi-process run on this machine
  tformer-aot             aot.py              does a config compile and fit on a TPU topology (no TPU needed)
  tformer-doctor          doctor.py           the troubleshooting checklists, run on a config
  tformer-bench           bench.py            benchmarks writing JSON (each in tformer_jax/bench/)

Each module has `main(argv) -> int` (anticipated errors raise) and `entry()`, the console command
(anticipated errors are one line and exit status 2: tformer_jax/cli_common/errors.py).
"""
