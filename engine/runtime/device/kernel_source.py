"""The CUDA source of a layer's map step (`STEP_HEADER`), shared by the step kernels (kernels.py)."""

# -- a layer's step as one CUDA kernel --------------------------------------------------------------
# One launch a layer: the demand step of its map, the prefetch step of its target's map when a
# prefetch rides along, and the fills of both. Each launch is host work (MLX's primitive, its
# evaluation, its graph node), and on the H200 what the device install adds to a token is about
# as much the host building the graph as the device evaluating it (docs/gpu.md, "One launch a
# layer, measured"); a layer was two kernels and three small operations, nine with a prefetch.
# A kernel cannot wait for all of its blocks, so every block runs the map steps itself, in its
# first warp (a map is a few hundred bytes, and the blocks run them at once), and keeps the fill
# lists in shared memory; block 0 alone writes the new maps out. Then every thread copies its
# share of the records. A job's map goes in and comes out as one array (MapState's block, the
# fill list in it), so a job costs the launch two arrays, three with its remapped indices.
#
# A map step is a sequence (each miss takes the least recently used slot left after the misses
# before it), so the entries are walked in order by every lane alike; what is parallel is each
# walk over the slots (the choice of a slot is a warp minimum) and the copies in and out. The maps
# live in shared memory for the step: a single thread walking them in global memory cost tens of
# microseconds a layer, a cost that grew with S. A slot's key is stamp * S + slot (a used slot's
# stamp counts as 2^31, after every real one), unique, so that the minimum names its slot. Lane 0
# alone writes the shared maps; a __syncwarp() stands between every read by all lanes and that
# write. A demand and a prefetch step differ where DEMAND says; PROTECT is a prefetch's
# protect_recent.
STEP_HEADER = """
__device__ inline long long titan_warp_min(long long best) {
  for (int o = 16; o > 0; o >>= 1) {
    const long long b = __shfl_xor_sync(0xffffffffu, best, o);
    best = b < best ? b : best;
  }
  return best;
}

template <int E, int S, bool DEMAND, bool PROTECT, typename I>
__device__ int titan_map_step(
    const I* inds, const int N, const int* slot_of, const int* expert_in, const int* stamp,
    const int* clock, const int* counters, const int* pending, int* slot_of_o, int* expert_in_o,
    int* stamp_o, int* clock_o, int* counters_o, int* pending_o, unsigned int* remapped,
    int* fill_e, int* fill_s, int* count, int* fe, int* fs) {
  __shared__ int so[E], ei[S], sto[S], pdo[S], n_out;
  __shared__ bool used[S], taken[S], seen[E];
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int M = N < S ? N : S;
    const long long NONE = 0x7fffffffffffffffLL;
    const int clk = clock[0];
    for (int x = lane; x < E; x += 32) { so[x] = slot_of[x]; seen[x] = false; }
    for (int s = lane; s < S; s += 32) {
      ei[s] = expert_in[s]; sto[s] = stamp[s]; pdo[s] = pending[s];
      used[s] = PROTECT && stamp[s] == clk - 1; taken[s] = false;
    }
    __syncwarp();
    for (int j = lane; j < N; j += 32) {
      const int e = (int)inds[j];
      if (e >= 0 && slot_of[e] >= 0) used[slot_of[e]] = true;
    }
    __syncwarp();
    int nfree = 0;
    for (int s = lane; s < S; s += 32) nfree += !used[s];
    for (int o = 16; o > 0; o >>= 1) nfree += __shfl_xor_sync(0xffffffffu, nfree, o);
    int n = 0, hits = 0, wasted = 0, rank = 0;
    for (int j = 0; j < N; ++j) {
      const int e = (int)inds[j];
      if (e < 0) continue;
      __syncwarp();
      const bool was_seen = seen[e];
      __syncwarp();
      if (was_seen) continue;
      if (lane == 0) seen[e] = true;
      if (slot_of[e] >= 0) {  // resident: a prefetch touches it, so that its demand step finds it
        if (DEMAND) ++hits; else if (lane == 0) sto[slot_of[e]] = clk;
        continue;
      }
      if (!DEMAND && rank++ >= nfree) continue;  // a prefetch takes only slots no entry uses
      long long best = NONE;
      for (int s = lane; s < S; s += 32)
        if (!used[s] && !taken[s]) {
          const long long key = (long long)stamp[s] * S + s;
          best = key < best ? key : best;
        }
      best = titan_warp_min(best);
      // none left: more experts than free slots, which a demand step's caller never plans
      const int v = best == NONE ? 0 : (int)(((best % S) + S) % S);
      __syncwarp();
      if (lane == 0) {
        taken[v] = true;
        const int old = ei[v];
        if (old >= 0) so[old] = -1;
        so[e] = v; ei[v] = e;
        if (n < M) { fe[n] = e; fs[n] = v; }
        if (!DEMAND) { pdo[v] = 1; sto[v] = clk; }
      }
      if (!DEMAND && pending[v]) ++wasted;  // a prefetch evicted before a demand step looked
      ++n;
    }
    __syncwarp();
    if (blockIdx.x == 0) {  // the new map, the fill list (padded with a slot that keeps its bytes)
      long long best = NONE;
      for (int s = lane; s < S; s += 32)
        if (!taken[s]) {
          const long long key = (used[s] ? 2147483648LL : (long long)stamp[s]) * S + s;
          best = key < best ? key : best;
        }
      best = titan_warp_min(best);
      const int pad = best == NONE ? fs[M - 1] : (int)(((best % S) + S) % S);
      for (int j = lane; j < M; j += 32) { fill_e[j] = j < n ? fe[j] : -1; fill_s[j] = j < n ? fs[j] : pad; }
      for (int x = lane; x < E; x += 32) slot_of_o[x] = so[x];
      int useful = 0;
      for (int s = lane; s < S; s += 32) {
        expert_in_o[s] = ei[s];
        if (DEMAND) {  // a prefetched slot is useful if this step uses it, wasted otherwise
          stamp_o[s] = used[s] || taken[s] ? clk : stamp[s];
          if (pending[s]) { if (used[s]) ++useful; else ++wasted; }
          pending_o[s] = 0;
        } else {
          stamp_o[s] = sto[s]; pending_o[s] = pdo[s];
        }
      }
      if (DEMAND) {
        for (int j = lane; j < N; j += 32) {
          const int e = (int)inds[j];
          remapped[j] = e >= 0 ? (unsigned int)so[e] : 0u;
        }
        for (int o = 16; o > 0; o >>= 1) {
          useful += __shfl_xor_sync(0xffffffffu, useful, o);
          wasted += __shfl_xor_sync(0xffffffffu, wasted, o);
        }
      }
      if (lane == 0) {
        count[0] = n;
        clock_o[0] = DEMAND ? clk + 1 : clk;
        counters_o[0] = counters[0] + hits;
        counters_o[1] = counters[1] + (DEMAND ? n : 0);
        counters_o[2] = counters[2] + (DEMAND ? 0 : n);
        counters_o[3] = counters[3] + useful;
        counters_o[4] = counters[4] + wasted;
      }
    }
    if (lane == 0) n_out = n;
  }
  __syncthreads();
  return n_out;
}
"""
