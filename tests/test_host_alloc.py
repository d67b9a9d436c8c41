"""The CLIs' allocator choice (tformer_jax/backends/cpu/host_alloc.py): the pure plan, and a real re-exec in a
subprocess that ends up running under the planned allocator exactly once; the train loop's
release-on-growth rule, by its readings and under a real tcmalloc."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tformer_jax.backends.cpu import host_alloc as ha

TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("env,tc,glibc,want", [
    ({}, TC, (2, 36), {"LD_PRELOAD": TC, ha.ENV_DONE: "tcmalloc"}),
    ({"LD_PRELOAD": "/x/libfoo.so"}, TC, (2, 36), {"LD_PRELOAD": f"{TC}:/x/libfoo.so", ha.ENV_DONE: "tcmalloc"}),
    ({}, None, (2, 36), {"GLIBC_TUNABLES": ha.HUGETLB, ha.ENV_DONE: "hugetlb"}),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, None, (2, 36),
     {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ha.HUGETLB}", ha.ENV_DONE: "hugetlb"}),
    ({ha.ENV_CHOICE: "hugetlb"}, TC, (2, 36), {"GLIBC_TUNABLES": ha.HUGETLB, ha.ENV_DONE: "hugetlb"}),
    ({}, None, (2, 31), None),  # glibc too old for the tunable: run as is
    ({ha.ENV_CHOICE: "system"}, TC, (2, 36), None),
    ({ha.ENV_DONE: "tcmalloc"}, TC, (2, 36), None),  # already re-executed: never loop
    ({"LD_PRELOAD": "/opt/libjemalloc.so.2"}, TC, (2, 36), None),  # the user's own allocator wins
])
def test_plan(env, tc, glibc, want):
  assert ha.plan(env, tc, glibc, platform="linux") == want


def test_plan_errors_and_other_platforms():
  assert ha.plan({}, TC, (2, 36), platform="darwin") is None
  with pytest.raises(ValueError, match="TFORMER_JAX_ALLOCATOR='fast'"):
    ha.plan({ha.ENV_CHOICE: "fast"}, TC, (2, 36), platform="linux")
  with pytest.raises(ValueError, match="no tcmalloc library"):
    ha.plan({ha.ENV_CHOICE: "tcmalloc"}, None, (2, 36), platform="linux")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD / glibc tunables are Linux")
@pytest.mark.parametrize("choice", ["auto", "system"])
def test_reexec_runs_once_under_the_planned_allocator(choice):
  code = ("import sys; from tformer_jax.backends.cpu import host_alloc as ha; print('start', flush=True); "
          "ha.maybe_reexec(); print('allocator', ha.loaded_allocator(), sys.argv[1:])")
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", ha.ENV_DONE)}
  env[ha.ENV_CHOICE] = choice
  p = subprocess.run([sys.executable, "-c", code, "a1", "--b=2"], env=env, capture_output=True, text=True,
                     timeout=60)
  assert p.returncode == 0, p.stderr
  planned = ha.plan(env, ha.find_tcmalloc(), ha.glibc_version())
  lines = p.stdout.splitlines()
  want = {None: "glibc", "tcmalloc": "tcmalloc", "hugetlb": "glibc+hugetlb"}[
      planned and planned[ha.ENV_DONE]]
  assert lines[-1] == f"allocator {want} ['a1', '--b=2']", p.stdout
  assert lines.count("start") == (2 if planned else 1)  # re-executed exactly once, arguments kept
  assert "re-running" not in p.stderr   # silent: resolve_runtime reports the allocator


def test_only_cpu_runs_reexec():
  assert ha.cpu_run({"JAX_PLATFORMS": "cpu"}, ["train.py", "--config=x"])
  assert not ha.cpu_run({"JAX_PLATFORMS": "cuda"}, ["train.py"])
  assert not ha.cpu_run({"JAX_PLATFORMS": "tpu,cpu"}, ["train.py"])
  for flag in ("--help", "-h", "--helpfull"):
    assert not ha.cpu_run({"JAX_PLATFORMS": "cpu"}, ["train.py", flag])
  # no JAX_PLATFORMS: a CPU run unless a GPU/TPU plugin for JAX is installed (none is here)
  plugins = any(importlib.util.find_spec(m) and (m != "libtpu" or ha._tpu_devices())   # libtpu alone: AOT
                for m in ha.ACCELERATOR_MODULES)
  assert ha.cpu_run({}, ["train.py"]) == (not plugins)


def test_release_on_growth_releases_only_when_the_free_heap_grows_past_the_slack():
  readings, released = iter([None, 100, 90, 150, 300, 310, 80, 500]), []
  guard = ha.ReleaseOnGrowth(slack_bytes=100, free=lambda: next(readings), release=lambda: released.append(1))
  got = [guard.check() for _ in range(8)]
  # unknown (glibc) -> no; 100 sets the level; 90 lowers it; 150 is within 100 of 90; 300 is past it:
  # release and start over; 310 sets the level anew, 80 lowers it, 500 is past it again
  assert got == [False, False, False, False, True, False, False, True] and len(released) == 2
  guard.reset()
  assert guard.level is None


@pytest.mark.skipif(ha.find_tcmalloc() is None, reason="tcmalloc is not installed (libtcmalloc-minimal4)")
def test_release_on_growth_under_tcmalloc_hands_a_grown_free_heap_back():
  code = """
import numpy as np
from tformer_jax.backends.cpu import host_alloc as ha
assert ha.free_bytes() is not None
g = ha.ReleaseOnGrowth(slack_bytes=64 << 20)
a = np.ones(1 << 25); del a; g.check()                        # a 256 MiB span freed: the level
assert not g.check()
b = [np.ones(1 << 24) for _ in range(6)]; del b                  # 768 MiB more freed: past the slack
before = ha.free_bytes()
assert g.check() and ha.free_bytes() < before - (256 << 20), (before, ha.free_bytes())
print("ok")
"""
  env = {**os.environ, "LD_PRELOAD": ha.find_tcmalloc()}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
