"""Config sections -> typed objects: model config, layouts, engine."""

from __future__ import annotations

import os

import jax

from rlhf_jax.engine.engine import Engine
from rlhf_jax.engine.sampling import SamplingParams
from rlhf_jax.models import hf
from rlhf_jax.models import model as model_lib
from rlhf_jax.models.config import ModelConfig
from rlhf_jax.parallel import mesh as mesh_lib
from rlhf_jax.rl.learner import OptimConfig, make_optimizer


def model_config(section, **fixed) -> ModelConfig:
  """ModelConfig from `config.model` (preset + overrides); `fixed` wins."""
  overrides = dict(section.overrides)
  overrides.update(param_dtype=section.param_dtype,
                   compute_dtype=section.compute_dtype, **fixed)
  return ModelConfig.preset(section.preset, **overrides)


def model(section, *, seed: int, layout, vocab_size: int):
  """(cfg, graphdef, params) on `layout`: HF checkpoint or random init.

  With `section.path` set (a local HF directory) the weights are loaded with
  `section.param_dtype` / `section.compute_dtype`; otherwise the preset +
  overrides are randomly initialised from `seed` with `vocab_size`.
  """
  path = section.get("path")
  if not path:
    cfg = model_config(section, vocab_size=vocab_size)
    return (cfg, *model_lib.init_params(cfg, seed, layout))
  cfg, graphdef, params = hf.load(path, layout=layout,
                                  dtype=section.param_dtype,
                                  compute_dtype=section.compute_dtype)
  if cfg.vocab_size < vocab_size:
    raise ValueError(f"the model in {path} has vocab_size={cfg.vocab_size}, "
                     f"smaller than its tokenizer's {vocab_size} ids")
  return cfg, graphdef, params


def layouts(section):
  """(train, rollout) layouts over one mesh from `config.mesh`."""
  devices = jax.devices()[:section.num_devices or None]
  mesh = mesh_lib.make_mesh(section.data, section.fsdp, section.tensor,
                            devices=devices)
  return (mesh_lib.train_layout(mesh),
          mesh_lib.rollout_layout(mesh, section.rollout_tensor))


def optimizer(section):
  """The optax chain (AdamW, clipping, schedule) of an `optim` section."""
  return make_optimizer(OptimConfig(
      learning_rate=section.learning_rate,
      warmup_steps=section.warmup_steps, decay_steps=section.decay_steps,
      end_lr_ratio=section.end_lr_ratio, b1=section.b1, b2=section.b2,
      weight_decay=section.weight_decay, grad_clip=section.grad_clip))


def sampling_params(section, stop_tokens=()) -> SamplingParams:
  return SamplingParams(
      temperature=section.temperature, top_k=section.top_k,
      top_p=section.top_p, max_new_tokens=section.max_new_tokens,
      stop_tokens=tuple(stop_tokens))


def engine(cfg: ModelConfig, graphdef, layout, section,
           stop_tokens=()) -> Engine:
  return Engine(cfg, graphdef, layout, num_rows=section.num_rows,
                samples_per_row=section.samples_per_row,
                prefill_buckets=tuple(section.prefill_buckets),
                sampling=sampling_params(section, stop_tokens),
                attention_impl=section.attention_impl,
                max_common_length=section.get("max_common_length", 0))


def eval_engine(cfg: ModelConfig, graphdef, layout, config,
                stop_tokens=()) -> Engine:
  """Greedy, one sample per row: the engine of held-out evaluation."""
  ro = config.rollout
  return Engine(cfg, graphdef, layout, num_rows=config.eval.num_rows,
                samples_per_row=1, prefill_buckets=tuple(ro.prefill_buckets),
                sampling=SamplingParams(temperature=0.0,
                                        max_new_tokens=ro.max_new_tokens,
                                        stop_tokens=tuple(stop_tokens)))


def policy_runtime(config, cfg: ModelConfig, graphdef, params, train_layout,
                   rollout_layout, stop_tokens) -> dict:
  """What every RL job runs its policy with: the rollout engine, the greedy
  eval engine and the training <-> rollout switch of one mesh."""
  return dict(
      engine=engine(cfg, graphdef, rollout_layout, config.rollout,
                    stop_tokens),
      eval_engine=eval_engine(cfg, graphdef, rollout_layout, config,
                              stop_tokens),
      colocation=colocation(config.mesh, train_layout, rollout_layout,
                            params))


def colocation(section, train_layout, rollout_layout, params):
  """The training <-> rollout switch of one mesh from `config.mesh`."""
  from rlhf_jax.trainers.colocate import Colocation

  return Colocation(train_layout, rollout_layout, params,
                    offload=section.offload,
                    layers_per_group=section.layers_per_group,
                    on_stale=section.stale_samples)


def workdir_outputs(config, workdir: str):
  """(writer, checkpointer, is_main): config.json saved, process 0 writes."""
  from rlhf_jax.checkpoint import Checkpointer
  from rlhf_jax.metrics import MetricWriter

  main_process = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if main_process:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  writer = MetricWriter(workdir, enabled=main_process)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                      keep=config.train.keep_checkpoints)
  return writer, ckpt, main_process
