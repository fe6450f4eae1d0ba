"""The fluid decode instance against a step-by-step reference."""

import os

import pytest

from rlhf_jax.sched.cost_model import costs
from rlhf_jax.sched.cost_model.hardware import get_hardware
from rlhf_jax.sim.instance import DecodeInstance, Sample
from rlhf_jax.sched.cost_model.profiles import get_model

MODEL, HW = get_model("qwen3-8b"), get_hardware("h100")


def _instance(slots=8, **kw):
  return DecodeInstance("i", MODEL, HW, 2, slots, kind="local",
                        start_time=0.0, **kw)


def _reference(lengths, prompt, slots):
  """Discrete decode loop: one token per running sample per step."""
  running = [[0, n] for n in lengths[:slots]]
  queue = list(lengths[slots:])
  t, finish = 0.0, []
  while running:
    kv = sum(prompt + g for g, _ in running)
    t += costs.decode_step_time(MODEL, HW, 2, len(running), kv)
    for r in running:
      r[0] += 1
    done = [r for r in running if r[0] == r[1]]
    running = [r for r in running if r[0] < r[1]]
    finish += [t] * len(done)
    while queue and len(running) < slots:
      running.append([0, queue.pop(0)])
  return finish


def test_fluid_matches_discrete_decode():
  lengths = [50, 120, 300, 301, 800, 80, 1000, 640]
  inst = _instance(slots=8)
  samples = [Sample(i, i, 0, 100, n) for i, n in enumerate(lengths)]
  for s in samples:
    inst._start(s)  # straight into a slot: no prefill, as in the reference.
  finished = inst.advance(1e9)
  got = sorted(s.finish_time for s in finished)
  want = sorted(_reference(lengths, 100, 8))
  assert len(got) == len(lengths)
  for g, w in zip(got, want):
    assert g == pytest.approx(w, rel=1e-3)


def test_tokens_survive_take_and_evict():
  inst = _instance(slots=2)
  a, b, c = (Sample(i, i, 0, 10, 1000) for i in range(3))
  for s in (a, b, c):
    inst.add(s, 0.0)
  t = inst.next_event_time()
  assert inst.advance(t / 2) == []
  (moved,) = inst.take(1, running=True, now=t / 2)
  assert 0 < moved.generated < 1000 and moved.location is None
  assert inst.n_running == 2  # the queued sample took the free slot.
  rest = inst.evict_all()
  assert {s.uid for s in rest} | {moved.uid} == {0, 1, 2}
  assert all(s.generated < 1000 for s in rest)
  assert inst.n_work == 0 and inst.kv_tokens == pytest.approx(0.0, abs=1e-6)


def test_prefix_shared_decode_reads_prompt_once_per_group():
  shared, plain = _instance(shared_prefix_decode=True), _instance()
  for inst in (shared, plain):
    for j in range(4):
      inst._start(Sample(j, 7, j, 500, 100))
  assert plain.kv_tokens == 2000
  assert shared.kv_tokens == 500


def test_dedup_prefill_prefills_each_prompt_once():
  dedup, plain = _instance(dedup_prefill=True), _instance()
  for inst in (dedup, plain):
    for j in range(4):
      inst.add(Sample(j, 7, j, 2000, 100), 0.0)
  # Oracle: one prefill of the prompt, i.e. the stall of the group's first
  # sample added alone to a fresh instance.
  alone = _instance()
  alone.add(Sample(0, 7, 0, 2000, 100), 0.0)
  one = alone.stall_until
  assert one > 0
  assert dedup.stall_until == pytest.approx(one, rel=1e-12)
  # Without dedup every sample prefills its 2000 prompt tokens: four
  # prefills (each at most `one`: a smaller mean context per sample).
  assert 3 * one < plain.stall_until <= 4 * one * (1 + 1e-12)
  # A different prompt on the dedup instance is prefilled again.
  dedup.add(Sample(4, 8, 0, 2000, 100), 0.0)
  assert dedup.stall_until > 1.5 * one


def test_cpu_profile_calibration_hook(tmp_path):
  from rlhf_jax.sched.cost_model import hardware  # pylint: disable=g-import-not-at-top
  missing = hardware.cpu_profile(str(tmp_path / "none.json"))
  assert missing.name == "cpu"
  path = tmp_path / "engine_costs_cpu.json"
  path.write_text('{"decode_mem_eff": 0.31, "step_overhead_s": 0.0012}')
  calibrated = hardware.cpu_profile(str(path))
  assert calibrated.name == "cpu_calibrated"
  assert calibrated.decode_mem_eff == 0.31
  assert calibrated.step_overhead_s == 0.0012
  assert calibrated.peak_flops == missing.peak_flops
  path.write_text('{"decode_eff": 0.3}')
  with pytest.raises(ValueError):
    hardware.cpu_profile(str(path))


def test_decode_calibration_recovers_the_cost_models_terms():
  """Step times made by `costs.decode_step_time` with a known efficiency
  and overhead (batch 1: memory-bound) give those
  back; one KV size cannot be fitted and is refused in one line."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from rlhf_jax.sched.cost_model import costs, hardware  # pylint: disable=g-import-not-at-top
  from rlhf_jax.sched.cost_model.profiles import get_model  # pylint: disable=g-import-not-at-top
  base = hardware.cpu_profile(os.path.join(os.sep, "no", "such.json"))
  true = dataclasses.replace(base, decode_mem_eff=0.27,
                             step_overhead_s=0.0031)
  model = get_model("tiny")
  kv = [512, 4096, 16384, 65536]
  step_s = [costs.decode_step_time(model, true, 1, 1, k) for k in kv]
  fit = hardware.decode_calibration(model.weight_bytes,
                                    model.kv_bytes_per_token, kv, step_s,
                                    base=base)
  assert fit["decode_mem_eff"] == pytest.approx(0.27, rel=0.01)
  assert fit["step_overhead_s"] == pytest.approx(0.0031, rel=0.03)
  assert fit["worst_rel_error"] < 0.01
  with pytest.raises(ValueError, match="two or more KV sizes"):
    hardware.decode_calibration(model.weight_bytes, model.kv_bytes_per_token,
                                [512, 512], step_s[:2], base=base)


def test_measured_step_cost_schedules_by_hand():
  """A measured step of 0.1 s and 2 slots: lengths 3 and 5 start at once,
  the 2-token sample takes the first free slot at 0.3 s and ends at 0.5 s
  with the 5-token one; no prefill time (it is in the measured step)."""
  inst = _instance(slots=2, step_s=0.1)
  samples = [Sample(i, i, 0, 100, n) for i, n in enumerate([3, 5, 2])]
  for s in samples:
    inst.add(s, 0.0)
  while (t := inst.next_event_time()) < float("inf"):
    inst.advance(t)
  assert [s.finish_time for s in samples] == pytest.approx([0.3, 0.5, 0.5])


def test_async_at_eta_zero_is_the_synchronous_step():
  """At measured costs, eta = 0 leaves nothing to overlap: each step is
  the batch's decode then its training, what `sync_step_s` gives."""
  from rlhf_jax.sched.named_policies import get_policy
  from rlhf_jax.sim import async_run
  from rlhf_jax.sched.cost_model.setting import Setting
  from rlhf_jax.sim.workload import Workload, WorkloadSpec

  setting = Setting(model="tiny", hardware="cpu", reserved_devices=8)
  work = Workload(WorkloadSpec(prompts_per_step=4, group_size=4,
                               median_len=20, max_len=64, prompt_len=8))
  unit = async_run.Measured(step_s=0.01, train_s=0.5, slots=8)
  result = async_run.run(setting, get_policy("baseline"), work, 5, eta=0,
                         rollout_devices=4, measured=unit)
  sync = [async_run.sync_step_s(setting, work.batch(i), unit)
          for i in range(5)]
  steps = [b - a for a, b in zip([0.0] + result.trained_at,
                                 result.trained_at)]
  assert steps == pytest.approx(sync)
  # eta = 1 overlaps decode with training: faster, never below training.
  faster = async_run.run(setting, get_policy("baseline"), work, 5, eta=1,
                         rollout_devices=4, measured=unit).trained_at
  assert faster[-1] < result.trained_at[-1]
  assert faster[-1] >= 5 * unit.train_s
