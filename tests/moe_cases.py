"""A tiny random Qwen3-MoE checkpoint and transformers' results on it: the
oracle of tests/models/test_moe.py and tests/models/test_routing_replay.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, E, K, F = 64, 8, 2, 24


def checkpoint(path, num_experts=E, router_std=0.5, seed=0):
  """(transformers model, its directory): 2 layers of `num_experts`
  experts, top 2; the router drawn at std 0.5 by default so its choices
  are clear (no near-ties for rounding to flip) and spread over the
  experts; `seed`: torch's, for the weights."""
  config = transformers.Qwen3MoeConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=num_experts,
      num_experts_per_tok=K, norm_topk_prob=True, tie_word_embeddings=False,
      initializer_range=0.1)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      config, attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:  # Norms are born 1 and would hide bugs.
        p.add_(0.1 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.normal_(0.0, router_std)
  model.save_pretrained(path)
  return model, path


def batch(B=8, T=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  mask = np.arange(T)[None] < rng.integers(T // 2, T + 1, B)[:, None]
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
  return tokens, positions, mask


def torch_reference(model, tokens, mask, weights):
  """transformers' logits, aux loss, router logits per layer, and the
  gradient of sum(logits * weights) over real tokens for the router and
  the experts, in our layouts: router [L, D, E], gate / up [L, E, D, F],
  down [L, E, F, D]."""
  model.zero_grad()
  out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
              attention_mask=torch.tensor(mask, dtype=torch.long),
              output_router_logits=True)
  loss = (out.logits * torch.tensor(weights * mask[..., None])).sum()
  loss.backward()
  grads = {"router": [], "gate": [], "up": [], "down": []}
  for layer in model.model.layers:
    experts = layer.mlp.experts
    grads["router"].append(layer.mlp.gate.weight.grad.T)
    gate_up = experts.gate_up_proj.grad  # [E, 2F, D]: gate rows, then up.
    grads["gate"].append(gate_up[:, :F].transpose(1, 2))
    grads["up"].append(gate_up[:, F:].transpose(1, 2))
    grads["down"].append(experts.down_proj.grad.transpose(1, 2))
  grads = {k: torch.stack(v).numpy() for k, v in grads.items()}
  return (out.logits.detach().numpy(), float(out.aux_loss.detach()),
          [r.detach().numpy() for r in out.router_logits], grads)
