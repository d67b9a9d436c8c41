r"""Auxiliary-loss-free balancing against the auxiliary loss (DeepSeek-V3, section 2.1.2: a per-expert bias
moved by sign(mean load - load) after each step balances the experts as well as the Switch loss does,
without the loss's pull on the main objective). A DeepSeek-V3-shaped MoE half: a dense first layer, then
2 MoE layers of 16 experts (top-4, sigmoid router, 4 groups of which the best 2 are eligible, one shared
expert); d_model 64, seq 128 x batch 16, 300 steps. The two arms, 2 seeds each:

  for s in 0 1; do
    tformer-train --config=configs/experiments/moe_balance.py --workdir=runs/exp/moe_balance/free_s$s \
      --config.train.seed=$s                                                   # bias updates, no aux loss
    tformer-train --config=configs/experiments/moe_balance.py --workdir=runs/exp/moe_balance/aux_s$s \
      --config.train.seed=$s --config.model.moe.bias_update_rate=0 --config.model.moe.aux_loss_coef=0.01
  done

(and --config.model.moe.bias_update_rate=0.01; =0 alone for the unbalanced baseline). Per MoE layer the logs
carry moe/layer_<i>/load_max_mean (the busiest expert's load over the mean); docs/experiments.md.
Measured (2 seeds, 176-586 s a run): val 2.1456 (rate 1e-3), 2.1335 (1e-2), 2.1475 (aux loss), 2.1459 (neither);
busiest expert over the mean, whole run: 2.58, 1.61, 1.69, 3.61.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=3, num_heads=4, steps=300)
  m = c.model
  m.d_model, m.d_ff, m.norm, m.activation, m.tie_embeddings = 64, 192, "rmsnorm", "swiglu", False
  mo = m.moe
  mo.num_experts, mo.top_k, mo.d_ff = 16, 4, 32
  mo.router, mo.n_group, mo.topk_group, mo.routed_scaling_factor = "sigmoid", 4, 2, 2.5
  mo.num_shared_experts, mo.first_k_dense = 1, 1
  mo.bias_update_rate, mo.aux_loss_coef, mo.z_loss_coef = 1e-3, 0.0, 0.0
  c.data.batch_size = 16
  c.train.log_every, c.train.eval_every, c.train.ckpt_every = 10, 300, 300
  return c
