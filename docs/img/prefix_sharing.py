"""Draws docs/img/prefix_sharing.png: prompt sharing in rollout and training.

  python docs/img/prefix_sharing.py
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

PROMPT, OWN, QUERY, PAD = "#4c72b0", "#dd8452", "#55a868", "#dddddd"


def _box(ax, x, y, w, h, color, text="", fs=8, tc="white"):
  ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black",
                         linewidth=0.6))
  if text:
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center",
            fontsize=fs, color=tc)


def _arrow(ax, a, b):
  ax.add_patch(FancyArrowPatch(a, b, arrowstyle="->", mutation_scale=9,
                               linewidth=0.8))


def _repeated(ax):
  ax.set_title("repeated: every sequence carries its prompt\n"
               "G prefills, G prompt KV copies, G x prompt in train fwd/bwd",
               fontsize=9)
  for g in range(4):
    y = 3.2 - g * 0.8
    _box(ax, 0, y, 5, 0.6, PROMPT, "prompt (copy %d)" % g)
    _box(ax, 5, y, 2.2, 0.6, OWN, "response %d" % g)
  ax.text(3.6, -0.1, "[B = N G, P + R] tokens", ha="center", fontsize=8)


def _shared(ax):
  ax.set_title("shared: prompt once, G responses attend to its K/V\n"
               "rollout (engine decode) and training (grouped layout)",
               fontsize=9)
  _box(ax, 0, 2.0, 5, 0.8, PROMPT, "prompt K/V: once per group")
  for g in range(4):
    y = 3.4 - g * 0.85 if g < 1 else 1.25 - (g - 1) * 0.7
    if g == 0:
      continue
    _box(ax, 5.6, y, 2.2, 0.55, OWN, "own %d" % g)
  _box(ax, 5.6, 2.1, 2.2, 0.55, OWN, "own 0")
  _box(ax, 8.6, 0.3, 1.2, 2.5, QUERY, "G x R\nqueries", fs=7)
  _arrow(ax, (8.6, 2.73), (5.0, 2.73))
  _arrow(ax, (8.6, 1.0), (7.8, 1.0))
  ax.text(2.5, 1.55, "prefix part: one [G R Q, K] x [K, P]\nmatmul per group "
          "and kv head\n-> O_a, L_a = logsumexp", ha="center", va="top",
          fontsize=7)
  ax.text(6.7, -0.35, "suffix part: causal\nover own tokens -> O_b, L_b",
          ha="center", va="top", fontsize=7)


def _mask(ax):
  ax.set_title("keys one response query sees (training, grouped)", fontsize=9)
  P, p_len, R = 8, 6, 5
  for i in range(R):  # Query rows: response positions.
    y = R - 1 - i
    for j in range(P):
      c = PROMPT if j < p_len else PAD
      _box(ax, j * 0.5, y * 0.5, 0.5, 0.5, c)
    for j in range(R):
      c = OWN if j <= i else PAD
      _box(ax, P * 0.5 + 0.3 + j * 0.5, y * 0.5, 0.5, 0.5, c)
  ax.text(P * 0.25, R * 0.5 + 0.15, "prompt keys (len_n of P)",
          ha="center", fontsize=7)
  ax.text(P * 0.5 + 0.3 + R * 0.25, R * 0.5 + 0.15, "own keys (causal)",
          ha="center", fontsize=7)
  ax.text(0.1, -0.45, "response token j at position len_n + j; "
          "grey = masked", fontsize=7)
  ax.text(0.1, -0.95, "O = exp(L_a - L) O_a + exp(L_b - L) O_b,  "
          "L = logaddexp(L_a, L_b)   (exact, fp32)", fontsize=7.5)
  ax.text(0.1, -1.45, "backward: autodiff sums the G responses' gradients "
          "into the prompt's K/V", fontsize=7)


def main():
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8),
                           gridspec_kw={"width_ratios": [1, 1.3, 1.1]})
  for ax, draw in zip(axes, (_repeated, _shared, _mask), strict=True):
    draw(ax)
    ax.set_aspect("equal")
    ax.autoscale_view()
    ax.axis("off")
  axes[0].set_xlim(-0.2, 7.4)
  axes[0].set_ylim(-0.4, 4.0)
  axes[1].set_xlim(-0.2, 10.0)
  axes[1].set_ylim(-1.2, 3.8)
  axes[2].set_xlim(-0.2, 7.2)
  axes[2].set_ylim(-1.7, 3.0)
  fig.tight_layout()
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     "prefix_sharing.png")
  fig.savefig(out, dpi=130)
  print(out)


if __name__ == "__main__":
  main()
