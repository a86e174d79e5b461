// CUDA kernels of zerofast::gather_cast: one block per span, each a straight run of elements.
// Torch-free on purpose; see gather_cast_kernels.h.
#include "gather_cast_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

namespace zerofast {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Loads each thread has in flight before its first store: memory latency, not arithmetic, is
// what bounds a copy.
constexpr int kUnroll = 4;

// torch's CUDA copy kernel converts through c10::Half and c10::BFloat16, whose device code
// narrows every value to float first (a double too) and then calls these same intrinsics.
// Converting the same way is what makes the result equal Tensor.to bit for bit, NaNs included.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(double v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename To>
__device__ To from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}

template <>
__device__ __forceinline__ double from_float<double>(float v) {
  return v;
}

template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);
}

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __float2bfloat16(v);
#else
  // Below sm_80 c10::BFloat16 rounds to nearest even in software, with a NaN of its own.
  if (isnan(v)) return __ushort_as_bfloat16(0x7FC0);
  const unsigned int bits = __float_as_uint(v);
  return __ushort_as_bfloat16(static_cast<unsigned short>((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16));
#endif
}

template <typename From, typename To>
struct Cast {
  __device__ __forceinline__ To operator()(From v) const { return from_float<To>(to_float(v)); }
};

template <typename Word>
struct Same {
  __device__ __forceinline__ Word operator()(Word v) const { return v; }
};

template <typename From, typename To, typename Op>
__global__ void __launch_bounds__(kThreads) span_kernel(const Span* __restrict__ spans, Op op) {
  const Span span = spans[blockIdx.x];
  const From* __restrict__ src = static_cast<const From*>(span.src);
  To* __restrict__ dst = static_cast<To*>(span.dst);
  const int64_t n = span.n;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < n; i += kUnroll * kThreads) {
    From v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * kThreads] = op(v[u]);
  }
  for (; i < n; i += kThreads) dst[i] = op(src[i]);
}

template <typename From, typename To, typename Op>
cudaError_t launch(const Span* spans, int64_t count, Op op, cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = INT_MAX;  // gridDim.x limit
  for (int64_t first = 0; first < count; first += kMaxBlocks) {
    const auto blocks = static_cast<unsigned int>(count - first < kMaxBlocks ? count - first : kMaxBlocks);
    span_kernel<From, To, Op><<<blocks, kThreads, 0, stream>>>(spans + first, op);
  }
  return cudaSuccess;
}

template <typename From>
cudaError_t cast_from(const Span* spans, int64_t count, Dtype to, cudaStream_t stream) {
  switch (to) {
    case Dtype::kFloat64:
      return launch<From, double>(spans, count, Cast<From, double>{}, stream);
    case Dtype::kFloat32:
      return launch<From, float>(spans, count, Cast<From, float>{}, stream);
    case Dtype::kFloat16:
      return launch<From, __half>(spans, count, Cast<From, __half>{}, stream);
    case Dtype::kBFloat16:
      return launch<From, __nv_bfloat16>(spans, count, Cast<From, __nv_bfloat16>{}, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename Word>
cudaError_t copy_words(const Span* spans, int64_t count, cudaStream_t stream) {
  return launch<Word, Word>(spans, count, Same<Word>{}, stream);
}

bool bad_table(const Span* spans, int64_t count) { return count < 0 || (count > 0 && spans == nullptr); }

}  // namespace

cudaError_t launch_cast(const Span* spans, int64_t count, Dtype from, Dtype to, cudaStream_t stream) {
  // A same-dtype "cast" through float would lose doubles and NaN payloads: that is a copy.
  if (bad_table(spans, count) || from == to) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (from) {
    case Dtype::kFloat64:
      return cast_from<double>(spans, count, to, stream);
    case Dtype::kFloat32:
      return cast_from<float>(spans, count, to, stream);
    case Dtype::kFloat16:
      return cast_from<__half>(spans, count, to, stream);
    case Dtype::kBFloat16:
      return cast_from<__nv_bfloat16>(spans, count, to, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy(const Span* spans, int64_t count, int word_bytes, cudaStream_t stream) {
  if (bad_table(spans, count)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (word_bytes) {
    case 1:
      return copy_words<unsigned char>(spans, count, stream);
    case 2:
      return copy_words<unsigned short>(spans, count, stream);
    case 4:
      return copy_words<unsigned int>(spans, count, stream);
    case 8:
      return copy_words<unsigned long long>(spans, count, stream);
    case 16:
      return copy_words<uint4>(spans, count, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace zerofast
