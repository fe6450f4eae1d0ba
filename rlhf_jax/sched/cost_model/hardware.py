"""Hardware profiles: peak rates, memory, links, prices and efficiency factors.

Every number below is either a vendor datasheet value (peak FLOP/s, HBM
bandwidth, memory size, link bandwidth), a list price, or an efficiency factor
taken once from a published single-component measurement. The same factors
serve every reproduction; none is fitted to a headline (see docs/sim.md).

Efficiency sources (fractions of peak):
  * decode_mem_eff = 0.77: vLLM Llama-3.1-8B batch-1 decode on A100 runs at
    ~77% of the HBM roofline (vLLM 0.23; johnmusgrave.com/p/
    vllm-throughput-latency-sweep-on): the fraction of HBM bandwidth a
    decode step achieves, scheduler overhead included.
  * train_mfu = 0.40: Llama 3 pre-training reports 38-43% BF16 MFU on H100
    (Llama 3 Herd of Models, Table 4). Used for fwd/bwd compute.
  * prefill_mfu = 0.50: prefill and scoring forwards are the same GEMMs as
    the training forward without backward or recompute; a judgement call
    above the Llama 3 range, not a measurement (docs/sim.md says so).
  * link_eff = 0.80: nccl-tests on DGX H100 reach ~360 of 450 GB/s NVLink bus
    bandwidth; multi-stream TCP reaches ~80% of line rate.

Prices: on-demand 8xH100 $83.79/h and spot 2xH100 $5.32/h are the averages a
third-party note reports for RLBoost's Table 3 [S]; L40S uses AWS
g6e.48xlarge on-demand ($30.13/h for 8 GPUs; its spot price is an assumed
60% discount that no reproduction uses); TPU v5e uses the GCP list price.
"""

import dataclasses
import json
import os

GB = 1e9
TB = 1e12
GBIT = 1e9 / 8  # bytes per second in one Gbit/s.


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator type and the node it lives in.

  Attributes:
    name: profile name.
    peak_flops: dense BF16 FLOP/s per device.
    hbm_bw: device memory bandwidth, bytes/s.
    hbm_bytes: device memory size, bytes.
    intra_bw: per-device intra-node link bandwidth (NVLink/ICI/PCIe), bytes/s.
    nic_bw: per-node frontend NIC bandwidth (weights to remote), bytes/s.
    rdma_bw: per-device backend (RDMA) bandwidth for KV migration, bytes/s.
    devices_per_node: accelerators per node / VM.
    ondemand_per_h: $ per device-hour on demand.
    spot_per_h: $ per device-hour on spot / preemptible capacity.
    decode_mem_eff: achieved fraction of hbm_bw in a decode step.
    prefill_mfu: achieved fraction of peak in prefill / scoring forwards.
    train_mfu: achieved fraction of peak in training fwd/bwd.
    link_eff: achieved fraction of intra_bw / nic_bw / rdma_bw.
    step_overhead_s: fixed per-decode-step cost (scheduler, launches). Zero
      on GPUs: the 77% decode measurement already includes it.
  """

  name: str
  peak_flops: float
  hbm_bw: float
  hbm_bytes: float
  intra_bw: float
  nic_bw: float
  rdma_bw: float
  devices_per_node: int
  ondemand_per_h: float
  spot_per_h: float
  decode_mem_eff: float = 0.77
  prefill_mfu: float = 0.50
  train_mfu: float = 0.40
  link_eff: float = 0.80
  step_overhead_s: float = 0.0


_PROFILES = {
    # H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s, 80 GB, NVLink4
    # 900 GB/s bidirectional (450 per direction). GCP a3-highgpu-8g frontend
    # NIC 200 Gbit/s; 8x400 Gbit/s RDMA per node.
    "h100": Hardware(
        name="h100", peak_flops=989e12, hbm_bw=3.35 * TB, hbm_bytes=80 * GB,
        intra_bw=450 * GB, nic_bw=200 * GBIT, rdma_bw=400 * GBIT,
        devices_per_node=8, ondemand_per_h=83.79 / 8, spot_per_h=5.32 / 2),
    # H200 SXM datasheet: H100 compute, 4.8 TB/s HBM3e, 141 GB. Priced like
    # H100 (no list price used anywhere).
    "h200": Hardware(
        name="h200", peak_flops=989e12, hbm_bw=4.8 * TB, hbm_bytes=141 * GB,
        intra_bw=450 * GB, nic_bw=200 * GBIT, rdma_bw=400 * GBIT,
        devices_per_node=8, ondemand_per_h=83.79 / 8, spot_per_h=5.32 / 2),
    # H800: H100 compute and HBM with NVLink cut to 400 GB/s; RLHFuse cluster
    # has 8x200 Gbit/s RoCEv2 per node. Priced like H100 (no public list).
    "h800": Hardware(
        name="h800", peak_flops=989e12, hbm_bw=3.35 * TB, hbm_bytes=80 * GB,
        intra_bw=200 * GB, nic_bw=200 * GBIT, rdma_bw=200 * GBIT,
        devices_per_node=8, ondemand_per_h=83.79 / 8, spot_per_h=5.32 / 2),
    # L40S datasheet: 362 TFLOP/s dense BF16, 864 GB/s GDDR6, 48 GB, PCIe
    # Gen4 x16 (32 GB/s per direction), no NVLink. g6e.48xlarge: 400 Gbit/s.
    "l40s": Hardware(
        name="l40s", peak_flops=362e12, hbm_bw=864 * GB, hbm_bytes=48 * GB,
        intra_bw=32 * GB, nic_bw=400 * GBIT, rdma_bw=50 * GBIT,
        devices_per_node=8, ondemand_per_h=30.13 / 8,
        spot_per_h=30.13 / 8 * 0.4),
    # TPU v5e datasheet: 197 TFLOP/s BF16, 819 GB/s, 16 GB, ICI 1600 Gbit/s.
    # GCP list: $1.20/chip-h on demand, $0.48 spot (approximate).
    "tpu_v5e": Hardware(
        name="tpu_v5e", peak_flops=197e12, hbm_bw=819 * GB, hbm_bytes=16 * GB,
        intra_bw=200 * GB, nic_bw=200 * GBIT, rdma_bw=100 * GBIT,
        devices_per_node=8, ondemand_per_h=1.20, spot_per_h=0.48),
}

# Defaults for this machine (2 shared cores, no accelerator) when no measured
# calibration exists yet: ~50 GFLOP/s per core of fp32 FMA at ~20% efficiency
# in XLA CPU, ~10 GB/s of usable DRAM bandwidth. These are rough guesses and
# docs/sim.md says so; the calibration JSON replaces them.
_CPU_DEFAULT = Hardware(
    name="cpu", peak_flops=100e9, hbm_bw=10 * GB, hbm_bytes=8 * GB,
    intra_bw=5 * GB, nic_bw=1 * GBIT, rdma_bw=1 * GBIT, devices_per_node=1,
    ondemand_per_h=0.10, spot_per_h=0.03, decode_mem_eff=0.5,
    prefill_mfu=0.2, train_mfu=0.2, link_eff=0.8, step_overhead_s=0.002)

CPU_CALIBRATION_ENV = "RLHF_JAX_CPU_CALIBRATION"
CPU_CALIBRATION_DEFAULT_PATH = "benchmarks/results/engine_costs_cpu.json"

_CALIBRATABLE = ("peak_flops", "hbm_bw", "decode_mem_eff", "prefill_mfu",
                 "train_mfu", "step_overhead_s", "hbm_bytes")


def cpu_profile(calibration_path: str | None = None) -> Hardware:
  """The CPU profile, overridden by measured engine costs when available.

  `python -m benchmarks.engine --calibration_out=PATH` writes the JSON
  object (`decode_calibration`): any subset of the Hardware fields in
  _CALIBRATABLE, e.g. {"decode_mem_eff": 0.31, "step_overhead_s": 0.0012}.
  Unknown keys fail loudly so a renamed field is noticed.

  Args:
    calibration_path: JSON file; defaults to $RLHF_JAX_CPU_CALIBRATION or
      benchmarks/results/engine_costs_cpu.json.

  Returns:
    The calibrated (or default) CPU Hardware profile.
  """
  path = calibration_path or os.environ.get(
      CPU_CALIBRATION_ENV, CPU_CALIBRATION_DEFAULT_PATH)
  if not os.path.exists(path):
    return _CPU_DEFAULT
  with open(path) as f:
    measured = json.load(f)
  unknown = set(measured) - set(_CALIBRATABLE)
  if unknown:
    raise ValueError(f"unknown CPU calibration keys {sorted(unknown)}")
  return dataclasses.replace(
      _CPU_DEFAULT, name="cpu_calibrated",
      **{k: float(v) for k, v in measured.items()})


def decode_calibration(weight_bytes: float, kv_bytes_per_token: float,
                       kv_tokens, step_s, base: Hardware = _CPU_DEFAULT
                       ) -> dict[str, float]:
  """`decode_mem_eff` and `step_overhead_s` of `base` from measured steps.

  `costs.decode_step_time` of a memory-bound step is
  (weights + kv_bytes_per_token * kv_tokens) / (hbm_bw * eff) + overhead,
  linear in 1 / (hbm_bw * eff) and the overhead: both are fitted to the
  measured (kv_tokens, step_s) pairs by least squares of the relative
  error, the overhead held at 0 where the free fit makes it negative. That
  model reads weights and KV at one bandwidth, so where the engine reads
  them at different rates the fit is a compromise; `worst_rel_error` says
  how far off it is.

  Args:
    weight_bytes: the measured model's weight bytes, as the simulator counts
      them (`cost_model/profiles.profile_of`), so eff is relative to that count.
    kv_bytes_per_token: KV bytes of one token over all layers, likewise.
    kv_tokens: KV tokens each measured step read (one per step time).
    step_s: the measured step times, seconds.
    base: the profile whose bandwidth the fraction refers to.

  Returns:
    {"decode_mem_eff", "step_overhead_s"} (what `cpu_profile` reads) and
    "worst_rel_error" of the fitted model over the measured steps.
  """
  x, y = [float(v) for v in kv_tokens], [float(v) for v in step_s]
  if len(x) != len(y) or len(set(x)) < 2 or min(y) <= 0:
    raise ValueError("decode_calibration needs positive step times at two or "
                     f"more KV sizes; got {len(set(x))} sizes, {len(y)} times")
  # Relative residuals r_i * s / t_i + o / t_i - 1, with s = 1 / bandwidth.
  u = [(weight_bytes + kv_bytes_per_token * a) / t
       for a, t in zip(x, y, strict=True)]
  v = [1 / t for t in y]
  suu, svv, suv = (sum(a * b for a, b in zip(p, q, strict=True))
                   for p, q in ((u, u), (v, v), (u, v)))
  su, sv = sum(u), sum(v)
  det = suu * svv - suv**2
  s, overhead = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
  if overhead < 0:
    s, overhead = su / suu, 0.0
  if s <= 0:
    raise ValueError("decode_calibration: step time does not grow with the "
                     "bytes read: too noisy to fit")
  worst = max(abs(a * s + b * overhead - 1)
              for a, b in zip(u, v, strict=True))
  return {"decode_mem_eff": 1 / (s * base.hbm_bw), "step_overhead_s": overhead,
          "worst_rel_error": worst}


def get_hardware(name: str | Hardware) -> Hardware:
  """Returns the named hardware profile ('cpu' reads the calibration hook;
  a profile is returned as it is)."""
  if isinstance(name, Hardware):
    return name
  if name == "cpu":
    return cpu_profile()
  if name not in _PROFILES:
    raise KeyError(f"unknown hardware {name!r}; have {sorted(_PROFILES)}")
  return _PROFILES[name]


# Device kinds (`jax.Device.device_kind`, lower case) -> profile names.
_KINDS = (("h100", "h100"), ("h200", "h200"), ("h800", "h800"),
          ("l40s", "l40s"), ("tpu v5 lite", "tpu_v5e"), ("tpu v5e", "tpu_v5e"))


def of_device(device) -> Hardware:
  """The profile of a live JAX device; KeyError names an unknown kind."""
  if device.platform == "cpu":
    return cpu_profile()
  kind = device.device_kind.lower()
  for key, name in _KINDS:
    if key in kind:
      return _PROFILES[name]
  raise KeyError(f"no hardware profile for device kind {device.device_kind!r}"
                 f"; have {sorted(_PROFILES)} and cpu")
