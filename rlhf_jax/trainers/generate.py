"""The generation demo: random tiny model, the paged engine, throughput."""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from rlhf_jax import typed_config
from rlhf_jax.config import sections
from rlhf_jax.engine.driver import Driver
from rlhf_jax.samples import Request
from rlhf_jax.models import model as model_lib
from rlhf_jax.models import rollout_copy
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rollout import build as rollout_build


def run(config, workdir: str):
  del workdir  # Nothing is written.
  model = typed_config.from_dict(sections.Model, config.model, "model")
  ro = typed_config.from_dict(sections.Rollout, config.rollout, "rollout")
  cfg = model.model_config()
  train, rollout = mesh_lib.layouts(
      typed_config.from_dict(sections.Mesh, config.mesh, "mesh"))
  graphdef, params = model_lib.init_params(cfg, config.seed, train)
  params = mesh_lib.to_layout(params, rollout)
  cfg, graphdef, _ = rollout_copy.rollout_model(
      cfg, graphdef, scan_layers=False if ro.unroll_layers else None)
  engine = rollout_build.engine(ro, cfg, graphdef, rollout)
  rng = np.random.default_rng(config.seed)
  g = ro.samples_per_row
  requests = [Request(i, rng.integers(0, cfg.vocab_size, config.prompt_len),
                      g, seed=config.seed) for i in range(config.num_prompts)]

  Driver(engine, params).run(requests[:1]).__next__()  # compile
  driver = Driver(engine, params)
  start = time.perf_counter()
  samples = list(driver.run(requests))
  seconds = time.perf_counter() - start
  tokens = sum(len(s.tokens) for s in samples)
  print(f"{len(samples)} samples ({config.num_prompts} prompts x {g}), "
        f"{tokens} tokens in {seconds:.2f}s: {tokens / seconds:.1f} tok/s, "
        f"{driver.stats.steps} decode steps, "
        f"{driver.stats.prefills} prefills, mesh {rollout.mesh.shape}")
  first = samples[0]
  logging.info("sample %s: %s", first.key, first.tokens)
  return samples
