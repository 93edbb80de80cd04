// The audio VAE's alias-free SnakeBeta (BigVGAN) in one pass: each output sample reads the few
// input samples its low-pass and upsampling filters reach and computes the activation of the
// upsampled signal in registers. Composed of candle's ops it took about 14 launches per run of
// channels, 16 runs per activation, 127 activations per decode: the audio decode was bound by
// launches at a few MB per tensor.

namespace {

__device__ __forceinline__ long clamp_index(long i, long n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }

}  // namespace

// x, y [rows, length] f32 (row = batch * channels + channel); alpha = exp(α) and inv_beta =
// 1 / (exp(β) + 1e-9) per channel; up_filter and down_filter of `taps` values each.
//   up[t] = ratio * Σ_j up_filter[t + crop_left - ratio j] x[clamp(j - pad_up)] over the j whose
// tap lies in the filter (the replicate-padded transposed convolution, cropped), for t < ratio *
// length; act = up + sin(alpha up)² inv_beta; y[n] = Σ_m down_filter[m] act[clamp(ratio n + m -
// down_left)] (the replicate-padded strided low-pass). One thread per output sample, grid-stride.
extern "C" __global__ void snake_beta_resample_f32(
    const float *__restrict__ x, float *__restrict__ y, const float *__restrict__ alpha,
    const float *__restrict__ inv_beta, const float *__restrict__ up_filter,
    const float *__restrict__ down_filter, int channels, long length, long items, int ratio,
    int taps, int pad_up, int crop_left, int down_left) {
  const long up_length = length * ratio, padded = length + 2L * pad_up;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < items;
       i += (long)gridDim.x * blockDim.x) {
    const long row = i / length, n = i - row * length;
    const int c = (int)(row % channels);
    const float *xr = x + row * length;
    const float a = alpha[c], ib = inv_beta[c];
    float acc = 0.f;
    for (int m = 0; m < taps; ++m) {
      const long top = clamp_index(n * ratio + m - down_left, up_length) + crop_left;
      const long first = top - taps + 1;
      const long lo = first <= 0 ? 0 : (first + ratio - 1) / ratio;
      const long hi = min(top / ratio, padded - 1);
      float u = 0.f;
      for (long j = lo; j <= hi; ++j) u += up_filter[top - ratio * j] * xr[clamp_index(j - pad_up, length)];
      u *= (float)ratio;
      const float s = sinf(a * u);
      acc += down_filter[m] * (u + s * s * ib);
    }
    y[i] = acc;
  }
}
