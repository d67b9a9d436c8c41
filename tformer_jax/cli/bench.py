"""`tformer-bench {train,attention,compile,decode,serve,moe,data,compare} [args]`: the benchmarks' dispatcher
(tformer_jax/bench/command.py, also `python -m tformer_jax.bench`); `tformer-bench --help` lists them."""
from tformer_jax.bench.command import MODULES, available, entry, main, usage  # noqa: F401 (the command's names)

if __name__ == "__main__":
  entry()
