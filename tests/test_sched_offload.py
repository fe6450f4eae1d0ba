"""RLBoost decisions: T_seed controller, N_prem cap, JSQ-Theta, balancing."""

import pytest

from rlhf_jax.sched import offload


def _obs(train_wait, remote_wait, n_prem=4.0, n_next=4, t_train=100.0,
         t_remote=80.0):
  return offload.StepObservation(
      t_train_wait=train_wait, t_remote_wait=remote_wait, t_train=t_train,
      t_remote=t_remote, n_prem=n_prem, n_prem_next=n_next)


def test_t_seed_grows_when_trainer_waits():
  c = offload.SeedWindowController(n_resv=4, t_init=100.0, eta=3.0)
  c.update(_obs(train_wait=30.0, remote_wait=0.0))
  assert c.t_seed == pytest.approx(110.0)


def test_t_seed_shrinks_when_remotes_wait_and_has_floor():
  c = offload.SeedWindowController(n_resv=4, t_init=20.0, eta=3.0,
                                   floor=5.0)
  c.update(_obs(train_wait=0.0, remote_wait=30.0))
  assert c.t_seed == pytest.approx(10.0)
  c.update(_obs(train_wait=0.0, remote_wait=300.0))
  assert c.t_seed == 5.0


def test_n_prem_cap_formula():
  c = offload.SeedWindowController(n_resv=4, t_init=50.0, eta=3.0)
  c.update(_obs(0.0, 0.0, n_prem=3.0, n_next=3, t_train=100.0,
                t_remote=80.0))
  # (t_remote * n_prem + T_seed * N_resv) / t_train = (240 + 200) / 100.
  assert c.n_prem_cap == pytest.approx(4.4)
  assert c.allowed_instances(10) == 5
  assert c.allowed_instances(2) == 2


def test_memory_stores_and_jumps():
  c = offload.SeedWindowController(n_resv=4, t_init=60.0, eta=3.0)
  c.update(_obs(0.0, 0.0, n_prem=4.0, n_next=4))
  assert c.memory == {4: 60.0}
  c.t_seed = 20.0
  c.update(_obs(0.0, 0.0, n_prem=2.0, n_next=4))  # count changed: jump back.
  assert c.t_seed == 60.0
  no_memory = offload.SeedWindowController(n_resv=4, t_init=60.0,
                                           use_memory=False)
  no_memory.update(_obs(0.0, 0.0))
  assert not no_memory.memory


def test_select_instance_joins_shortest_pending_queue():
  views = [offload.QueueView(2, 10, 10), offload.QueueView(0, 10, 10),
           offload.QueueView(1, 3, 10)]
  assert offload.select_instance(views, theta=4) == 1
  # Equal pending: the one with more free slots.
  views = [offload.QueueView(0, 10, 10), offload.QueueView(0, 3, 10)]
  assert offload.select_instance(views, theta=4) == 1


def test_select_instance_waits_when_all_at_theta():
  views = [offload.QueueView(4, 10, 10), offload.QueueView(5, 10, 10)]
  assert offload.select_instance(views, theta=4) is None


def test_balance_moves_pending_to_starving_instance():
  views = [offload.QueueView(6, 8, 8), offload.QueueView(0, 8, 8)]
  moves = offload.balance_moves(views, plateau=4)
  assert moves and all(m[:2] == (0, 1) and not m[3] for m in moves)
  moved = sum(m[2] for m in moves)
  assert 1 <= moved <= 5


def test_balance_moves_running_above_plateau_to_idle_instance():
  views = [offload.QueueView(0, 20, 32), offload.QueueView(0, 0, 32)]
  assert offload.balance_moves(views, plateau=8) == [(0, 1, 12, True)]
  # At or below the plateau nothing moves: it would not speed anything up.
  views = [offload.QueueView(0, 8, 32), offload.QueueView(0, 0, 32)]
  assert offload.balance_moves(views, plateau=8) == []


def test_batching_plateau():
  # Saturating throughput b / (1 + b / 10): 80% of the max at b ~ 40.
  throughput = lambda b: b / (1 + b / 10)
  b = offload.batching_plateau(throughput, 256, fraction=0.8)
  assert throughput(b) >= 0.8 * throughput(256) > throughput(b - 1)


def test_select_least_work_prefers_least_predicted_tokens():
  views = [offload.QueueView(0, 5, 10), offload.QueueView(1, 5, 10)]
  assert offload.select_least_work(views, [500.0, 100.0], theta=4) == 1
  assert offload.select_least_work(views, [500.0, 100.0], theta=1) == 0
