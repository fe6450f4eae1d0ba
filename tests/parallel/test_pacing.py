"""`parallel/pacing.Pacer`: how far the host runs ahead of the devices.

The markers are fakes whose readiness the test sets, so the bound is checked
whatever the backend does (on CPU a sharded launch returns only after most of
its run, so real programs are never 8 deep; see tests_audit.md defect 3).
"""

from rlhf_jax.parallel import pacing


class _Marker:
  """One output of a dispatched program: unfinished until the test finishes
  it or the host blocks on it."""

  def __init__(self, name, waits):
    self.name, self.ready, self._waits = name, False, waits

  def is_ready(self):
    return self.ready

  def block_until_ready(self):
    if not self.ready:  # A call on a finished program costs no wait.
      self._waits.append(self.name)
    self.ready = True
    return self


def _dispatch_all(pacer, n, finish_before=None):
  """Dispatches n markers; before dispatch k the test finishes the markers
  in finish_before.get(k, ()) (the devices caught up on their own). Returns
  the markers, the waits each dispatch caused and how many markers were
  unfinished after each dispatch."""
  finish_before = finish_before or {}
  waits, markers, waits_per_call, unfinished = [], [], [], []
  for k in range(n):
    for j in finish_before.get(k, ()):
      markers[j].ready = True
    markers.append(_Marker(k, waits))
    before = len(waits)
    pacer.dispatched(markers[-1])
    waits_per_call.append(waits[before:])
    unfinished.append(sum(not m.ready for m in markers))
  return markers, waits_per_call, unfinished


def test_blocks_on_the_oldest_exactly_when_one_more_would_exceed_max_ahead():
  # max_ahead = 3, nothing finishes on its own. By hand: dispatches 0, 1, 2
  # leave 1, 2, 3 unfinished (3 is allowed). Dispatch 3 would make 4, so the
  # host waits for the oldest, 0; dispatch 4 waits for 1, and so on: dispatch
  # k >= 3 waits for exactly k - 3 and leaves 3 unfinished.
  _, waits, unfinished = _dispatch_all(pacing.Pacer(3), 7)
  assert waits == [[], [], [], [0], [1], [2], [3]]
  assert unfinished == [1, 2, 3, 3, 3, 3, 3]


def test_default_bound_is_max_ahead_dispatches():
  # MAX_AHEAD = 8: the first 8 dispatches never wait; the 9th (index 8)
  # waits for the 1st (index 0), the 10th for the 2nd.
  assert pacing.MAX_AHEAD == 8
  _, waits, unfinished = _dispatch_all(pacing.Pacer(), 10)
  assert waits == [[]] * 8 + [[0], [1]]
  assert unfinished == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8]


def test_no_wait_when_the_devices_kept_up():
  # max_ahead = 2; markers 0 and 1 finish before dispatch 2, marker 2
  # before dispatch 4. By hand (the pacer's queue after each dispatch):
  #   d0: [0]; d1: [0, 1]: no wait, 1 then 2 unfinished;
  #   d2: [0, 1, 2] is over 2: pops 0, already done: no wait; {2} unfinished;
  #   d3: [1, 2, 3]: pops 1, done: no wait; {2, 3};
  #   d4: [2, 3, 4]: pops 2, done (finished before d4): no wait; {3, 4};
  #   d5: [3, 4, 5]: pops 3, unfinished: the one wait; {4, 5}.
  _, waits, unfinished = _dispatch_all(
      pacing.Pacer(2), 6, finish_before={2: (0, 1), 4: (2,)})
  assert waits == [[], [], [], [], [], [3]]
  assert unfinished == [1, 2, 1, 2, 2, 2]
