"""The `device` install: a decode step with no host synchronisation inside it.

Algorithm 1 reads each MoE layer's routed experts back to the host to find its misses, and on a
GPU that round trip, sixteen times a token, costs more than the misses themselves (issue 29:
the offloaded H200 decode ran at a fifth of resident decoding while a probe of reads driven from
the device reached 0.92 of it). Here the host never looks:

- every expert sits in the *host tier* (`hosttier.py`): mapped pinned host memory;
- each layer keeps its *slot map* on the device (`state.py`: expert -> slot, slot -> expert, a
  last-use stamp per slot, a step clock and counters, one int32 array);
- a *map step* takes the router's indices as they are on the device (static shape, rows x top-k),
  keeps hits in their slots, gives each miss the least recently used slot this step does not use,
  and returns the indices remapped to slots and the list of (expert, slot) to fill: Algorithm 1's
  lines 11-14 with its LRU policy, run by the device;
- a *fill* copies the missed records from the host tier into those slots;
- mlx-lm's own SwitchGLU then computes over the slot tables with the remapped indices: the same
  call, in the same shapes, on the same bytes as mlx-lm's, so the logits are mlx-lm's bit for bit;
- rows that route to more experts than slots (a prompt, a batch) are computed over a *many-rows
  area* instead: every expert the rows name, at its own index, copied once per layer (a resident
  one from its slot), and mlx-lm's call with the router's own indices (with `area_ahead`, the
  next layer's whole area is copied on a stream of its own while this one computes); the latest
  rows' experts then take their slots from the area, so that a decode after a prompt starts warm.

All of it is lazy MLX work in the token's graph, queued like mlx-lm's own `generate_step` queues
a resident model's; counters stay on the device until asked for (`stats.py`).

Two implementations of the steps, chosen per `DeviceCache(mode=...)`:
- `kernel` (a CUDA GPU, `kernels.py`): one `mx.fast.cuda_kernel` a layer and token, which runs
  the layer's map step, and the prefetch step of the layer it predicts for when one rides along,
  then copies the records to fill across PCIe straight into the slot tables' memory; one more
  makes a many-rows area;
- `ops` (the CPU, CI, and a fallback on a GPU, `ops.py`): the same algorithm as MLX operations.
  Tests check the two give the same maps on a GPU, the ops against a NumPy model of the algorithm
  on the CPU, and the kernels on emulated CUDA threads against the ops on the CPU
  (tests/test_kernels.py).

Predictions for prefetching are made on the device too (`prefetch.py`).
"""

from .cache import DeviceCache
from .prefetch import DevicePrefetch

__all__ = ["DeviceCache", "DevicePrefetch"]
