"""The weight-rule engine: a family's tensor rules checked against the files (names, shapes, config sizes) and
applied both ways (import_tensors, export_tensors), plus Mixtral's expert layout."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.config import ModelConfig
from tformer_jax.interop import axes
from tformer_jax.interop.families import Family, HFConfigError, OneOf, Rule
from tformer_jax.interop.families.llama import MIXTRAL_ROWS
from tformer_jax.interop.hf.common import _MAX_LISTED, HFWeightsError, log
from tformer_jax.nn import Transformer
from tformer_jax.nn.moe import expert_hidden, shared_hidden
from tformer_jax.nn.stacking import unstack_layers

# ----------------------------------------------------------------------------------------------
# Parameters


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{'layers_0/attn/wq': shape, ...} of an unscanned Transformer(cfg), without allocating."""
  cfg = dataclasses.replace(cfg, scan_layers=False)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
  return {k: tuple(v.shape) for k, v in flatten(nn.unbox(shapes["params"])).items()}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for path, v in flat.items():
    node = out
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _sizes(cfg: ModelConfig) -> dict[str, int]:
  a = cfg.mla
  return dict(d=cfg.d_model, h=cfg.num_heads, g=cfg.kv_heads, k=cfg.hd, f=cfg.ff, v=cfg.vocab_size,
              e=cfg.moe.num_experts, x=expert_hidden(cfg) if cfg.moe.num_experts else 0, p=cfg.max_len,
              t=cfg.type_vocab_size, s=shared_hidden(cfg) if cfg.moe.num_experts else 0,
              # MLA: q bottleneck, K/V latent, latent + RoPE key, q/k head, k + v head, v head
              q=a.q_lora_rank, l=a.kv_lora_rank, c=a.kv_lora_rank + a.qk_rope_head_dim,
              j=a.qk_nope_head_dim + a.qk_rope_head_dim, u=a.qk_nope_head_dim + a.v_head_dim, w=a.v_head_dim,
              m=cfg.d_model)   # m: d_model again, for a matrix with d on both sides (MTP's eh_proj)


def _expand(template: str, layer: int | None) -> str:
  return template if layer is None else template.replace("{i}", str(layer))


def _hf_names(rule: Rule, layer: int | None, cfg: ModelConfig) -> list[str]:
  name = _expand(rule.hf, layer)
  return [name.replace("{e}", str(e)) for e in range(cfg.moe.num_experts)] if "{e}" in name else [name]


def _instances(item: Rule | OneOf, cfg: ModelConfig) -> list[tuple[int | None, tuple[tuple[Rule, ...], ...]]]:
  """(layer, options) pairs: every rule (set) once per layer if it is per-layer, else once."""
  options = item.options if isinstance(item, OneOf) else ((item,),)
  per_layer = any("{i}" in r.hf for opt in options for r in opt)
  return [(i, options) for i in (range(cfg.num_layers) if per_layer else [None])]


def _applicable(rules: tuple[Rule, ...], layer: int | None, have: Mapping[str, Any]) -> list[Rule]:
  """The rules whose parameters our model has (all targets, or none: anything else is a table bug)."""
  out = []
  for r in rules:
    present = [_expand(t, layer) in have for t in r.targets]
    if all(present):
      out.append(r)
    elif any(present):
      raise AssertionError(f"family table: rule {r.hf} targets only partly exist in the model")
  return out


def _normalise_names(family: Family, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  out: dict[str, np.ndarray] = {}
  for name, arr in tensors.items():
    n = name[len(family.strip):] if family.strip and name.startswith(family.strip) else name
    for pattern, repl in family.renames:
      n = re.sub(pattern, repl, n)
    if n in out:
      raise HFWeightsError(f"tensor {name} duplicates {n} (two spellings of the same weight)")
    out[n] = arr
  if family.prefix and out and not any(n.startswith(family.prefix) for n in out):
    out = {family.prefix + n: a for n, a in out.items()}  # a headless base-model checkpoint
  return out


def _listed(names: list[str]) -> str:
  more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
  return ", ".join(names[:_MAX_LISTED]) + more


# What config.json calls each size (the first key present is named in errors), and the size each layout
# letter stands for.
_CONFIG_KEYS = {"num_layers": ("n_layer", "num_hidden_layers"), "d_model": ("n_embd", "hidden_size", "n_embed"),
                "num_heads": ("n_head", "num_attention_heads"), "num_kv_heads": ("num_key_value_heads",),
                "head_dim": ("head_dim",), "d_ff": ("n_inner", "intermediate_size"), "vocab_size": ("vocab_size",),
                "moe.num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                "moe.d_ff": ("moe_intermediate_size", "intermediate_size"),
                "moe.shared_d_ff": ("moe_intermediate_size",), "mla.q_lora_rank": ("q_lora_rank",),
                "mla.kv_lora_rank": ("kv_lora_rank",), "mla.qk_rope_head_dim": ("qk_rope_head_dim",),
                "mla.qk_nope_head_dim": ("qk_nope_head_dim",), "mla.v_head_dim": ("v_head_dim",),
                "max_len": ("n_positions", "max_position_embeddings", "seq_length"),
                "type_vocab_size": ("type_vocab_size",)}
_LETTER_FIELDS = {"d": "d_model", "h": "num_heads", "g": "num_kv_heads", "k": "head_dim", "f": "d_ff",
                  "v": "vocab_size", "e": "moe.num_experts", "x": "moe.d_ff", "p": "max_len", "t": "type_vocab_size",
                  "s": "moe.shared_d_ff", "q": "mla.q_lora_rank", "l": "mla.kv_lora_rank", "c": "mla.qk_rope_head_dim",
                  "j": "mla.qk_nope_head_dim", "u": "mla.v_head_dim", "w": "mla.v_head_dim",
                  "m": "d_model"}
_MAX_INDEX_DIGITS = 9


def _config_key(hf_cfg: Mapping[str, Any], field: str, value: int) -> str:
  key = next((k for k in _CONFIG_KEYS.get(field, ()) if hf_cfg.get(k) is not None), None)
  return f"{key}={hf_cfg[key]!r}" if key else f"{field}={value} (derived)"


def _spans(indices: set[int]) -> str:
  """{0, 1, 2, 5} -> '0-2, 5' (the first few runs)."""
  runs: list[list[int]] = []
  for i in sorted(indices):
    if runs and i == runs[-1][1] + 1:
      runs[-1][1] = i
    else:
      runs.append([i, i])
  text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:4]]
  return ", ".join(text) + (", ..." if len(runs) > 4 else "")


def _is_range(indices: set[int], n: int) -> bool:
  """indices == {0, ..., n-1}, without building that set (n comes from config.json)."""
  return len(indices) == n and (not indices or (min(indices) == 0 and max(indices) == n - 1))


def _all_rules(family: Family) -> list[Rule]:
  return [r for item in family.rules + family.mtp
          for opt in (item.options if isinstance(item, OneOf) else ((item,),)) for r in opt]


# ----------------------------------------------------------------------------------------------
# Multi-token prediction modules as extra layers: our 'mtp_<k>' is HF layer num_layers + k (DeepSeek-V3)

_MTP_OWN = ("enorm", "hnorm", "eh_proj", "final_norm")   # the module's own parameters; the rest is its block


def mtp_depth_held(family: Family, cfg: ModelConfig, names: Mapping[str, Any]) -> int:
  """How many multi-token prediction modules the tensors hold: layers num_layers, num_layers + 1, ... with
  any of the family's MTP tensors (a decoder layer alone does not count)."""
  names = _normalise_names(family, names)
  k = 0
  while k < len(names) and any(_expand(r.hf, cfg.num_layers + k) in names for r in family.mtp):
    k += 1
  return k


def _mtp_as_layers(flat: Mapping[str, Any], n: int) -> dict[str, Any]:
  """'mtp_<k>/block/attn/wq' -> 'layers_<n+k>/attn/wq', 'mtp_<k>/enorm/scale' -> 'layers_<n+k>/enorm/scale'."""
  out = {}
  for key, v in flat.items():
    m = re.fullmatch(r"mtp_(\d+)/(?:block/)?(.*)", key)
    out[f"layers_{n + int(m[1])}/{m[2]}" if m else key] = v
  return out


def _layers_as_mtp(flat: Mapping[str, Any], n: int) -> dict[str, Any]:
  """The inverse of `_mtp_as_layers`."""
  out = {}
  for key, v in flat.items():
    m = re.fullmatch(r"layers_(\d+)/(.*)", key)
    if m and int(m[1]) >= n:
      rest = m[2] if m[2].split("/")[0] in _MTP_OWN else f"block/{m[2]}"
      key = f"mtp_{int(m[1]) - n}/{rest}"
    out[key] = v
  return out


def _with_mtp_layers(cfg: ModelConfig) -> ModelConfig:
  """The config whose num_layers counts the MTP modules as layers (for iterating the per-layer rules)."""
  return dataclasses.replace(cfg, num_layers=cfg.num_layers + cfg.mtp_depth, mtp_depth=0)


_INDEX_PATTERNS: dict[str, re.Pattern] = {}


def _index_pattern(family: Family) -> re.Pattern:
  """One regex matching every per-layer / per-expert tensor name of the family; its groups i<n> / e<n>
  capture the layer and expert numbers."""
  if family.model_type not in _INDEX_PATTERNS:
    num = f"[0-9]{{1,{_MAX_INDEX_DIGITS}}}"
    alts = [re.escape(r.hf).replace(r"\{i\}", f"(?P<i{n}>{num})").replace(r"\{e\}", f"(?P<e{n}>{num})")
            for n, r in enumerate(_all_rules(family)) if "{i}" in r.hf or "{e}" in r.hf]
    _INDEX_PATTERNS[family.model_type] = re.compile("|".join(alts) or "(?!)")
  return _INDEX_PATTERNS[family.model_type]


def _indices(family: Family, names: Mapping[str, Any]) -> tuple[set[int], set[int]]:
  """The layer and expert numbers the tensor names hold."""
  layers: set[int] = set()
  experts: set[int] = set()
  pattern = _index_pattern(family)
  for n in names:
    m = pattern.fullmatch(n)
    for g, v in (m.groupdict().items() if m else ()):
      if v is not None:
        (layers if g[0] == "i" else experts).add(int(v))
  return layers, experts


def _shape_mismatches(family: Family, cfg: ModelConfig, hf_cfg: Mapping[str, Any],
                      names: Mapping[str, tuple[int, ...]], files: Mapping[str, str], has_experts: bool
                      ) -> tuple[dict[str, list[tuple[str, str]]], set[str]]:
  """({config keys: [(mismatch, ' (in FILE)')]}, the size letters some present tensor confirmed): every
  present tensor's shape against the one the family's layout and the config's sizes give."""
  sizes = _sizes(cfg)
  seen: set[str] = set()
  wrong: dict[str, list[tuple[str, str]]] = {}
  for rule in _all_rules(family):
    if "{e}" in rule.hf and not has_experts:
      continue
    groups = axes.parse(rule.hf_axes)
    want = axes.shape_of(rule.hf_axes, sizes)
    for layer in (range(cfg.num_layers + cfg.mtp_depth) if "{i}" in rule.hf else [None]):
      for n in (n for n in _hf_names(rule, layer, cfg) if n in names):
        got = tuple(names[n])
        if len(got) != len(want):
          bad = [a for g in groups for a in g]
        else:
          bad = [a for g, w, s in zip(groups, want, got) if w != s for a in g]
        if not bad:
          seen.update(a for g in groups for a in g if not a.isdigit())
          continue
        keys = ", ".join(_config_key(hf_cfg, _LETTER_FIELDS[a], sizes[a])
                         for a in dict.fromkeys(bad) if not a.isdigit()) or "the family's layout"
        file = f" (in {files[n]})" if files.get(n) else ""
        wrong.setdefault(keys, []).append((f"tensor {n} has shape {got}, expected {want}", file))
  return wrong, seen


def check_weights(family: Family, cfg: ModelConfig, hf_cfg: Mapping[str, Any],
                  shapes: Mapping[str, tuple[int, ...]], where: str = "config.json",
                  origin: Mapping[str, str] | None = None) -> None:
  """The sizes config.json implies against the tensors present, before any model is built: the number
  of layers and of experts (from the tensor names), then every dimension of every tensor present
  (from the family's layouts). Costs O(tensors + layers * rules), never more than the files hold;
  HFWeightsError in one line naming config.json's key (`where`), the tensor and its file."""
  origin = origin or {}
  names = _normalise_names(family, shapes)
  files = _normalise_names(family, {n: origin.get(n, "") for n in shapes})
  layers, experts = _indices(family, names)
  per_layer = [r.hf for r in _all_rules(family) if "{i}" in r.hf]
  if per_layer and not _is_range(layers, cfg.num_layers + cfg.mtp_depth):
    held = (f"{len(layers)} layer(s) (numbered {_spans(layers)})" if layers
            else f"no per-layer tensors (such as {_expand(per_layer[0], 0)})")
    mtp = f" and {cfg.mtp_depth} multi-token prediction layer(s) after them" if cfg.mtp_depth else ""
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'num_layers', cfg.num_layers)}{mtp} does not match the "
                         f"weights, which hold {held}")
  n_experts = cfg.moe.num_experts
  per_expert = [r.hf for r in _all_rules(family) if "{e}" in r.hf]
  if per_expert and experts and not _is_range(experts, n_experts):
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'moe.num_experts', n_experts)} does not match the "
                         f"weights, which hold {len(experts)} expert(s) (numbered {_spans(experts)})")
  wrong, seen = _shape_mismatches(family, cfg, hf_cfg, names, files, bool(experts))
  if wrong:
    parts = [f"{items[0][0]} from {keys}{items[0][1]}" + (f" (and {len(items) - 1} more)" if len(items) > 1 else "")
             for keys, items in list(wrong.items())[:_MAX_LISTED]]
    raise HFWeightsError(f"{where} does not match the weights: " + "; ".join(parts))
  if per_expert and n_experts and not experts and "e" not in seen:
    example = _expand(per_expert[0], 0).replace("{e}", "0")
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'moe.num_experts', n_experts)} does not match the "
                         f"weights, which hold no expert tensors (such as {example})")


def import_tensors(family: Family, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                   where: str = "checkpoint") -> dict[str, np.ndarray]:
  """HF tensors -> our flat float32 params {'layers_0/attn/wq': array}. Raises HFWeightsError naming
  every missing, unexpected and mis-shaped tensor, before converting any."""
  tensors = _normalise_names(family, tensors)
  try:
    want = _mtp_as_layers(expected_shapes(cfg), cfg.num_layers)   # MTP modules as layers num_layers, ...
  except (OverflowError, ValueError, TypeError) as e:
    raise HFConfigError(f"{where}: the config's sizes describe no model that can be built "
                        f"({' '.join(str(e).split())[:200]})") from None
  sizes = _sizes(cfg)
  plan, used, missing, bad_shape = _import_plan(family, _with_mtp_layers(cfg), tensors, want, sizes)
  unexpected, dropped = _leftovers(family, tensors, used, tied="head" not in want)
  problems = []
  if missing:
    problems.append(f"missing tensor(s): {_listed(missing)}")
  if unexpected:
    problems.append(f"unexpected tensor(s): {_listed(unexpected)}")
  if bad_shape:
    problems.append("shape mismatch: " + "; ".join(bad_shape[:_MAX_LISTED]))
  if problems:
    raise HFWeightsError(f"{family.model_type} {where}: " + " | ".join(problems))
  if dropped:
    log.warning("%s: dropping %d tensor(s) our %s model has no place for: %s", where, len(dropped),
                family.model_type, _listed(dropped))
  return _layers_as_mtp(_convert(family, plan, tensors, want, sizes), cfg.num_layers)


def _import_plan(family: Family, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                 want: Mapping[str, tuple[int, ...]], sizes: Mapping[str, int]
                 ) -> tuple[list[tuple[Rule, list[str], list[str]]], set[str], list[str], list[str]]:
  """(plan: (rule, its HF tensors, our targets) for every rule that applies, the HF names it uses, the
  missing names, the shape mismatches); of alternative rule sets (OneOf), the first whose tensors are
  all present."""
  plan: list[tuple[Rule, list[str], list[str]]] = []
  used: set[str] = set()
  missing: list[str] = []
  bad_shape: list[str] = []
  for item in family.rules + family.mtp:
    for layer, options in _instances(item, cfg):
      rule_sets = [_applicable(opt, layer, want) for opt in options]
      present = [all(n in tensors for r in rs for n in _hf_names(r, layer, cfg)) for rs in rule_sets]
      for rule in rule_sets[present.index(True)] if any(present) else rule_sets[0]:
        names = _hf_names(rule, layer, cfg)
        absent = [n for n in names if n not in tensors]
        if absent:
          missing += absent
          continue
        used.update(names)
        shape = axes.shape_of(rule.hf_axes, sizes)
        bad = [f"tensor {n} has shape {tuple(tensors[n].shape)}, expected {shape}" for n in names
               if tuple(tensors[n].shape) != shape]
        if bad:
          bad_shape += bad
          continue
        plan.append((rule, names, [_expand(t, layer) for t in rule.targets]))
  return plan, used, missing, bad_shape


def _leftovers(family: Family, tensors: Mapping[str, np.ndarray], used: set[str], tied: bool
               ) -> tuple[list[str], list[str]]:
  """(unexpected, dropped): the tensors no rule used, less those the family ignores."""
  unexpected, dropped = [], []
  skip = family.ignore + (family.ignore_tied if tied else ())
  for n in sorted(set(tensors) - used):
    if any(re.search(p, n) for p in skip):
      continue
    (dropped if any(re.search(p, n) for p in family.drop) else unexpected).append(n)
  return unexpected, dropped


def _convert(family: Family, plan: list[tuple[Rule, list[str], list[str]]], tensors: Mapping[str, np.ndarray],
             want: Mapping[str, tuple[int, ...]], sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
  """Every tensor fits: only now read and convert them (float32, our layout)."""
  out: dict[str, np.ndarray] = {}
  for rule, names, targets in plan:
    results = axes.rearrange([tensors[n] for n in names], rule.hf_axes, rule.ours_axes, sizes,
                             what=f"tensor {names[0]}")
    for t, r in zip(targets, results):
      if tuple(r.shape) != want[t]:
        raise AssertionError(f"family table {family.model_type}: {rule.hf} gives {t} the shape {r.shape}, "
                             f"the model has {want[t]}")
      out[t] = np.asarray(r, dtype=np.float32)
  unfilled = sorted(set(want) - set(out))
  if unfilled:
    raise AssertionError(f"family table {family.model_type} has no source for {_listed(unfilled)}")
  return out


def _unscan(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """A scan_layers params tree as layers_0 .. layers_{L-1} (nn.stacking)."""
  if "layers" not in params:
    return dict(params)
  return unstack_layers(params, cfg.num_layers, cfg.cycle)


def export_tensors(family: Family, cfg: ModelConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Our params -> {HF tensor name: float32 array} in the layout save_pretrained writes."""
  flat = {k: np.asarray(v, dtype=np.float32) for k, v in flatten(_unscan(nn.unbox(params), cfg)).items()}
  want = expected_shapes(cfg)
  wrong = [f"{k} has shape {flat[k].shape}, expected {s}" for k, s in want.items()
           if k in flat and flat[k].shape != s]
  absent = sorted(set(want) - set(flat))
  if wrong or absent:
    raise HFWeightsError(f"params do not match the model config: missing {absent[:_MAX_LISTED]}; "
                         + "; ".join(wrong[:_MAX_LISTED]))
  sizes = _sizes(cfg)
  n = cfg.num_layers
  flat = _mtp_as_layers(flat, n)   # MTP modules as layers num_layers, ...
  # The shared tensors each MTP layer repeats (a tied model's head: the embedding).
  copies = [(layer, ((r if r.ours in flat else dataclasses.replace(r, ours="embed", ours_axes="v d"),),))
            for layer in range(n, n + cfg.mtp_depth) for r in family.mtp_copies]
  out: dict[str, np.ndarray] = {}
  used: set[str] = set()
  instances = [inst for item in family.rules + family.mtp for inst in _instances(item, _with_mtp_layers(cfg))]
  for layer, options in instances + copies:
    for rule in _applicable(options[0], layer, flat):
      targets = [_expand(t, layer) for t in rule.targets]
      names = _hf_names(rule, layer, cfg)
      arrays = [flat[t] for t in targets]
      if rule.hf_axes or rule.ours_axes:
        results = axes.rearrange(arrays, rule.ours_axes, rule.hf_axes, sizes, what=f"param {targets[0]}")
      else:
        results = arrays
      used.update(targets)
      out.update({name: np.ascontiguousarray(r) for name, r in zip(names, results)})
  left = sorted(set(flat) - used)
  if left:
    raise HFWeightsError(f"{family.model_type} has no place for param(s) {_listed(left)}")
  return out


def mixtral_to_params(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
  """transformers-5 MixtralSparseMoeBlock weights (numpy; `prefix` stripped) -> our MoEFFN params.

  HF stores gate.weight (E, H), experts.gate_up_proj (E, 2I, H) (gate rows first, then up) and
  experts.down_proj (E, H, I); ours are router (H, E), w_gate/w_up (E, H, I), w_down (E, I, H):
  the layouts of the Mixtral family table's fused (in-memory module) option."""
  sd = {k[len(prefix):]: np.asarray(v) for k, v in state_dict.items() if k.startswith(prefix)}
  e, two_x, d = sd["experts.gate_up_proj"].shape
  sizes = dict(e=e, x=two_x // 2, d=d)
  fused = next(item for item in MIXTRAL_ROWS if isinstance(item, OneOf)).options[1]
  block = "model.layers.{i}.mlp."
  out: dict[str, np.ndarray] = {}
  for rule in fused:
    name = rule.hf[len(block):]
    arrays = axes.rearrange([sd[name]], rule.hf_axes, rule.ours_axes, sizes, what=f"tensor {name}")
    out.update({t.rsplit("/", 1)[-1]: a for t, a in zip(rule.targets, arrays)})
  return out
