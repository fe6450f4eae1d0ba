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
  # Instance 1 has no pending work and every slot busy: it takes its free
  # slots (8 - 8 = 0) + 1 = one request, from the longest queue.
  views = [offload.QueueView(6, 8, 8), offload.QueueView(0, 8, 8)]
  assert offload.balance_moves(views, plateau=4) == [(0, 1, 1, False)]
  # With 3 free slots it takes 3 + 1 = 4 of the 6, one request per move.
  views = [offload.QueueView(6, 8, 8), offload.QueueView(0, 5, 8)]
  assert offload.balance_moves(views, plateau=4) == [(0, 1, 1, False)] * 4
  # The source always keeps its last request: 2 pending give up only one.
  views = [offload.QueueView(2, 8, 8), offload.QueueView(0, 0, 8)]
  assert offload.balance_moves(views, plateau=4) == [(0, 1, 1, False)]


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


@pytest.mark.parametrize("max_batch", [1, 2, 7, 64, 256, 1000])
def test_batching_plateau_bisection_equals_the_scan(max_batch):
  """For nondecreasing throughputs (rooflines: a fixed cost plus per-
  sequence costs, memory- or compute-bound, a flat one) the bisection
  picks the batch the linear scan picks, in at most log2 + 1 calls."""
  curves = [lambda b: b / (1 + b / 10), lambda b: b / max(3.0, 0.5 * b),
            lambda b: 5.0, lambda b: min(b, 17) * 2.0,
            lambda b: b / (0.02 + 0.001 * b + max(0.01, 0.004 * b))]
  for curve in curves:
    for fraction in (0.1, 0.5, 0.8, 1.0):
      calls = []
      counted = lambda b, f=curve: calls.append(b) or f(b)  # noqa: E731
      got = offload.batching_plateau(counted, max_batch, fraction,
                                     nondecreasing=True)
      assert got == offload.batching_plateau(curve, max_batch, fraction)
      assert len(calls) <= max_batch.bit_length() + 1


def test_select_least_work_prefers_least_predicted_tokens():
  views = [offload.QueueView(0, 5, 10), offload.QueueView(1, 5, 10)]
  assert offload.select_least_work(views, [500.0, 100.0], theta=4) == 1
  assert offload.select_least_work(views, [500.0, 100.0], theta=1) == 0


def test_cap_count_rounds_as_algorithm_one():
  assert offload.cap_count(5, float("inf")) == 5
  assert offload.cap_count(5, 2.7) == 3      # round(3.2)
  assert offload.cap_count(5, 0.2) == 1      # At least one.
  assert offload.cap_count(2, 9.0) == 2      # Never above n.
  ctl = offload.SeedWindowController(n_resv=1)
  ctl.n_prem_cap = 2.7
  assert ctl.allowed_instances(5) == offload.cap_count(5, 2.7)


def test_worker_moves_drop_self_moves_and_running_without_plateau():
  views = [offload.QueueView(3, 4, 4), offload.QueueView(0, 0, 4)]
  moves = offload.balance_moves(views, offload.NO_PLATEAU)
  assert any(s == d for s, d, _, _ in moves)  # A self-move...
  kept = offload.worker_moves(views, None)
  assert kept and all(s != d for s, d, _, _ in kept)  # ...is dropped.
  assert kept == [m for m in moves if m[0] != m[1]]
  idle = [offload.QueueView(0, 6, 8), offload.QueueView(0, 0, 8)]
  assert offload.worker_moves(idle, None) == []           # No plateau.
  assert offload.worker_moves(idle, 2) == [(0, 1, 4, True)]
