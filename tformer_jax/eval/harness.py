"""Our models inside EleutherAI's lm-evaluation-harness: the `tformer` model class.

  lm = TformerLM(hf="path/to/hf_model")            # or workdir="runs/x" (latest checkpoint, or step=N)
  lm_eval.simple_evaluate(model=lm, tasks=["shakespeare_next_line"], task_manager=task_manager())

The harness hands the model three kinds of request; each is answered the way its Hugging Face backend
(`lm_eval.models.huggingface.HFLM`) answers it, so the two give the same metrics on the same weights:
- loglikelihood(context, continuation): the sum of the continuation's token log-probabilities and
  whether greedy decoding would produce it. Context and continuation are encoded together and split
  (the harness's `TemplateLM._encode_pair`); an empty context is the prefix token (BOS, else EOS).
  Inputs longer than max_length + 1 lose tokens on the left. Scored by one jitted forward
  (`score_step`): the model's final hidden states and `ops.losses.nll_and_correct` over them.
- loglikelihood_rolling(text): the whole text's log-likelihood over the harness's rolling windows
  (`lm_eval.utils.get_rolling_token_windows` + `make_disjoint_window`, each window a loglikelihood).
- generate_until(context, gen_kwargs): KV-cache decoding (`tformer_jax.decode.generate_stream`),
  greedy unless the task samples, at most max_gen_toks tokens (default 256), the context cut on the
  left to max_length - max_gen_toks; a row stops at EOS or at a stop string (`until`, EOS's text
  added) that is one token, inside the compiled loop, and the text is cut before the first stop string.
Requests are sorted by length (longest first), run batch_size at a time (the last batch padded to
batch_size rows) and padded to a length bucket (a power of two, at least 16, at most max_length),
so the scoring step compiles once per bucket; a progress bar counts requests.

Tokens as the harness's hf backend makes them: an HF tokenizer.json encodes with its special tokens
(its post-processor, e.g. Llama's BOS) unless the text already starts with the prefix token's text;
add_bos_token=True/False forces BOS on/off. Our byte / sentencepiece tokenizers add nothing by
default (our training batches hold no BOS). Generated text is decoded without special tokens.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from typing import Any, Callable, Iterable, Sequence

import flax.linen as nn
import jax
import numpy as np
import tokenizers
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from tformer_jax import backends, config as config_lib, decode, model_loading
from tformer_jax.checkpoint import restore_params
from tformer_jax.data.tokenizers import HFTokenizer
from tformer_jax.ops import losses

MIN_BUCKET = 16
DEFAULT_MAX_GEN_TOKS = 256
_LOGITS_BUDGET = 1 << 26   # float32 logits entries a scoring call may hold at once (256 MiB); more: chunked


def length_bucket(n: int, max_length: int) -> int:
  """The padded length compiled for n tokens: the next power of two (>= 16), at most max_length."""
  return min(max(MIN_BUCKET, 1 << (int(n) - 1).bit_length()), max(int(max_length), int(n)))


# ------------------------------------------------------------------------------------- tokens


class HarnessTokenizer:
  """Our tokenizer with the encode/decode conventions of the harness's hf backend (module docstring)."""

  def __init__(self, tok: Any, add_bos_token: bool | None = None):
    self.tok, self.add_bos_token = tok, add_bos_token
    self.bos_id, self.eos_id = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
    self.vocab_size = int(tok.vocab_size)
    # an HF tokenizer.json: the library itself, so its post-processor adds what transformers' would
    self._hf = tokenizers.Tokenizer.from_file(str(tok.path)) if isinstance(tok, HFTokenizer) else None

  def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
    add = self.add_bos_token if add_special_tokens is None else add_special_tokens
    if self._hf is not None:
      ids = self._hf.encode(text, add_special_tokens=True if add is None else add).ids
    else:
      ids = [int(i) for i in self.tok.encode(text)] if text else []
    if add and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id] + ids
    return [int(i) for i in ids]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    ids = [int(i) for i in ids]
    if self._hf is not None:
      return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
      ids = [i for i in ids if i not in (self.bos_id, self.eos_id)]
    return self.tok.decode(ids)

  def token_text(self, i: int | None) -> str | None:
    return None if i is None else self.decode([i], skip_special_tokens=False)


# ------------------------------------------------------------------------------------ loading


def load(workdir: str | None = None, hf: str | None = None, step: int | None = None
         ) -> tuple[Any, Any, Any, Any]:
  """(model, params, tokenizer, config for the runtime) of a training workdir or an HF directory."""
  if bool(workdir) == bool(hf):
    raise config_lib.ConfigError("tformer harness model: pass exactly one of workdir=RUN, hf=DIR")
  if hf:
    model, params, tok = model_loading.load_hf(hf)
    return model, params, tok, config_lib.default_config()
  cfg, params = restore_params(workdir, step)
  model = model_loading.model_from_config(cfg)
  params = model_loading.check_params(model, params, str(workdir))
  return model, params, model_loading.tokenizer_from_config(cfg), cfg


def score_step(model: Any, chunk: int) -> Callable:
  """jit(params, tokens_BxL, targets_BxL) -> (log p(target) (B, L) float32, argmax == target (B, L))."""
  def score(params, tokens_BxL, targets_BxL):
    h_BxLxD, unembed_DxV = model.apply({"params": params}, tokens_BxL, return_hidden=True)
    nll_BxL, correct_BxL = losses.nll_and_correct(h_BxLxD, unembed_DxV, targets_BxL, chunk=chunk,
                                                  softcap=float(getattr(model.cfg, "final_logit_softcap", 0.0)))
    return -nll_BxL, correct_BxL
  return jax.jit(score)


@dataclasses.dataclass
class _Row:
  """One scoring row: input tokens, their next-token targets, how many trailing ones are scored."""
  inp: list[int]
  targets: list[int]
  n_scored: int


# ------------------------------------------------------------------------------------ the model


@register_model("tformer")
class TformerLM(TemplateLM):
  """lm-evaluation-harness model backed by a tformer_jax Transformer (module docstring).

  workdir / hf / step: where the weights come from (`load`); batch_size: rows per step;
  max_length: the context (default: the model's max_len); max_gen_toks: the default generation
  length; add_bos_token / prefix_token_id: as the hf backend's arguments of these names;
  gen_chunk: tokens decoded between stop-string checks (0: one compiled loop of max_gen_toks, which
  ends rows at EOS and at one-token stop strings; a stop string inside a longer token is cut after).
  """

  def __init__(self, workdir: str | None = None, hf: str | None = None, step: int | None = None,
               batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
               add_bos_token: bool | None = None, prefix_token_id: int | None = None, gen_chunk: int = 0,
               seed: int = 0, model: Any = None, params: Any = None, tokenizer: Any = None,
               config: Any = None, **_: Any):
    super().__init__()
    if model is None:
      model, params, tokenizer, config = load(workdir, hf, None if step in (None, "") else int(step))
    if not model.cfg.causal or not model.cfg.lm_head:
      raise config_lib.ConfigError("tformer harness model: needs a causal decoder with an LM head")
    self.model, self.params = model, nn.unbox(params)
    self.tok = HarnessTokenizer(tokenizer, _as_bool(add_bos_token))
    if self.tok.vocab_size > model.cfg.vocab_size:
      raise config_lib.ConfigError(f"tformer harness model: the tokenizer's vocabulary ({self.tok.vocab_size}) "
                                   f"is larger than the model's ({model.cfg.vocab_size})")
    self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
    self._max_length = int(max_length) if max_length else int(model.cfg.max_len)
    self._max_gen_toks, self.gen_chunk, self.seed = int(max_gen_toks), int(gen_chunk), int(seed)
    self._prefix = None if prefix_token_id in (None, "") else int(prefix_token_id)
    self.runtime = backends.resolve_runtime(config or config_lib.default_config(), model=model.cfg, quiet=True)
    self._steps: dict[int, Callable] = {}
    self.source = str(workdir or hf or "in-memory model")

  # --- what TemplateLM asks of a model
  @property
  def eot_token_id(self) -> int | None:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    """BOS, else EOS, else (a tokenizer without special tokens) the first token of a newline."""
    if self._prefix is not None:
      return self._prefix
    for i in (self.tok.bos_id, self.tok.eos_id):
      if i is not None:
        return int(i)
    return self.tok.encode("\n", add_special_tokens=False)[0]

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self.tok.tok, "name", type(self.tok.tok).__name__))

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                 **kwargs: Any) -> list[int]:
    prefix = self.tok.token_text(self.prefix_token_id)
    if add_special_tokens is None and prefix and string.startswith(prefix):
      add_special_tokens = False
    ids = self.tok.encode(string, add_special_tokens)
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
    return self.tok.decode(tokens, skip_special_tokens)

  # --- scoring
  def _step(self, b: int, l: int) -> Callable:
    vocab = self.model.cfg.vocab_size
    chunk = 0 if b * l * vocab <= _LOGITS_BUDGET else max(1, _LOGITS_BUDGET // vocab)
    if chunk not in self._steps:
      self._steps[chunk] = score_step(self.model, chunk)
    return self._steps[chunk]

  def _score_rows(self, rows: Sequence[_Row], desc: str, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(sum of the scored tokens' log-probs, all of them greedy) per row, batched by length."""
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].inp), rows[i].inp))
    bar = tqdm(total=len(rows), desc=desc, unit="req", disable=disable_tqdm or None, file=sys.stderr)
    with backends.use(self.runtime.backend):
      for start in range(0, len(order), self.batch_size):
        idx = order[start:start + self.batch_size]
        l = length_bucket(len(rows[idx[0]].inp), self.max_length)
        tokens = np.zeros((self.batch_size, l), np.int32)
        targets = np.zeros((self.batch_size, l), np.int32)
        for r, i in enumerate(idx):
          n = len(rows[i].inp)
          tokens[r, :n], targets[r, :n] = rows[i].inp, rows[i].targets
        logp, greedy = self._step(self.batch_size, l)(self.params, tokens, targets)
        logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
        for r, i in enumerate(idx):
          n, k = len(rows[i].inp), rows[i].n_scored
          out[i] = (float(logp[r, n - k:n].sum()), bool(greedy[r, n - k:n].all()))
        bar.update(len(idx))
    bar.close()
    return out  # type: ignore[return-value]

  def _row(self, context: list[int], continuation: list[int]) -> _Row:
    if not context or not continuation or len(continuation) > self.max_length:
      raise ValueError(f"loglikelihood request with {len(context)} context and {len(continuation)} "
                       f"continuation tokens (each needs >= 1, the continuation <= {self.max_length})")
    whole = (context + continuation)[-(self.max_length + 1):]
    return _Row(whole[:-1], whole[1:], len(continuation))

  def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                            **kwargs: Any) -> list[tuple[float, bool]]:
    rows = [self._row(ctx, cont) for _, ctx, cont in requests]
    res = self._score_rows(rows, "loglikelihood", disable_tqdm)
    for (key, _, _), r in zip(requests, res):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, r)
    return res

  def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
    rows, owner = [], []
    for n, (text,) in enumerate(req.args for req in requests):
      windows = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                   max_seq_len=self.max_length, context_len=1)
      for ctx, cont in map(lm_utils.make_disjoint_window, windows):
        rows.append(self._row(list(ctx), list(cont)))
        owner.append(n)
    scores = self._score_rows(rows, "loglikelihood_rolling", disable_tqdm)
    totals = [0.0] * len(requests)
    for n, (logp, _) in zip(owner, scores):
      totals[n] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # --- generation
  def _context_ids(self, context: str, max_ctx: int) -> list[int]:
    """The hf backend's tok_batch_encode for one context: no specials after a literal BOS text."""
    bos = self.tok.token_text(self.tok.bos_id)
    add = False if bos and context.startswith(bos) else None
    ids = self.tok.encode(context, add)
    return ids[-max_ctx:] if len(ids) > max_ctx else ids

  def _stop_tokens(self, until: Sequence[str]) -> list[int]:
    """EOS and the stop strings that are one token: the compiled loop ends a row on them."""
    out = [] if self.tok.eos_id is None else [int(self.tok.eos_id)]
    for s in until:
      ids = self.tok.encode(s, add_special_tokens=False) if s else []
      if len(ids) == 1 and ids[0] not in out:
        out.append(ids[0])
    return out

  def _generate_batch(self, contexts: Sequence[str], kwargs: dict, until: list[str], max_gen: int) -> list[str]:
    max_ctx = self.max_length - max_gen
    if max_ctx <= 0:
      raise ValueError(f"max_gen_toks ({max_gen}) must be less than the model's max_length ({self.max_length})")
    prompts = [self._context_ids(c, max_ctx) or [self.prefix_token_id] for c in contexts]
    prompts += [prompts[0]] * (self.batch_size - len(prompts))     # a fixed batch: fewer compiled shapes
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
    eos = self.tok.eos_id
    stream = decode.generate_stream(
        self.model, self.params, prompts, max_new_tokens=max_gen, chunk_size=self.gen_chunk or max_gen,
        temperature=temperature, top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
        stop_tokens=self._stop_tokens(until), rng=self.seed, pad_id=-1)
    ids: list[list[int]] = [[] for _ in contexts]
    ended = [False] * len(contexts)
    for chunk in stream:
      for r in range(len(contexts)):
        if ended[r]:
          continue
        new = [int(t) for t in chunk[r] if t >= 0]
        if eos is not None and eos in new:
          new, ended[r] = new[:new.index(eos)], True
        ids[r] += new
        ended[r] = ended[r] or any(s and s in self.tok.decode(ids[r]) for s in until)
      if all(ended):
        stream.close()
        break
    return [postprocess_generated_text(self.tok.decode(t), until, None) for t in ids]

  def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
    args = [req.args for req in requests]
    out: list[str | None] = [None] * len(args)
    groups: dict[str, list[int]] = {}
    for i, (_, gen_kwargs) in enumerate(args):
      groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
    eos_text = self.tok.token_text(self.eot_token_id)
    bar = tqdm(total=len(args), desc="generate_until", unit="req", disable=disable_tqdm or None, file=sys.stderr)
    with backends.use(self.runtime.backend):
      for idx in groups.values():
        kwargs = dict(normalize_gen_kwargs(args[idx[0]][1], self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen = int(kwargs.pop("max_gen_toks"))
        idx = sorted(idx, key=lambda i: (-len(self.tok_encode(args[i][0])), args[i][0]))
        for start in range(0, len(idx), self.batch_size):
          part = idx[start:start + self.batch_size]
          texts = self._generate_batch([args[i][0] for i in part], kwargs, until, max_gen)
          for i, s in zip(part, texts):
            out[i] = s
            self.cache_hook.add_partial("generate_until", args[i], s)
          bar.update(len(part))
    bar.close()
    return out  # type: ignore[return-value]


def _as_bool(v: Any) -> bool | None:
  """A model_args value ('True', 'false', ...) as a bool; None / '' stay None."""
  if v is None or v == "":
    return None
  if isinstance(v, str):
    return v.strip().lower() in ("1", "true", "yes")
  return bool(v)


# ------------------------------------------------------------------------------------- tasks


TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"


def task_manager(include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                 include_defaults: bool = True) -> Any:
  """The harness's TaskManager over ours (tformer_jax/eval/tasks), include_path and, with
  include_defaults, the harness's own tasks (indexing those takes seconds)."""
  from lm_eval.tasks import TaskManager  # noqa: PLC0415 (lm_eval.tasks is imported on first use)
  extra = [] if include_path is None else [include_path] if isinstance(include_path, (str, os.PathLike)) \
      else list(include_path)
  return TaskManager(include_path=[str(TASKS_DIR)] + [str(p) for p in extra], include_defaults=include_defaults)


def task_manager_for(names: Sequence[str], include_path: Any = None) -> tuple[Any, list[str]]:
  """(a TaskManager that knows `names`, the names none knows): without the harness's own tasks when
  ours and include_path's hold them all."""
  manager = task_manager(include_path, include_defaults=False)
  if any(not manager.match_tasks([n]) for n in names):
    manager = task_manager(include_path)
  return manager, [n for n in names if not manager.match_tasks([n])]


def shipped_tasks() -> list[str]:
  """The names of the shipped tasks (one YAML each, named as its task)."""
  return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
