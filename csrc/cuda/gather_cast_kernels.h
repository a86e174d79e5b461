// Torch-free interface of the CUDA gather/cast kernels: device pointers, counts and a stream.
//
// Nothing here includes torch, so the kernels compile with nvcc alone. CI has no CUDA build of
// torch, and this is what lets it compile every kernel anyway; the torch side lives in the glue
// (gather_cast_cuda.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gather_plan.h"

namespace zerofast {
namespace cuda {

enum class Dtype : int32_t { kFloat64 = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Both launch one block per entry of `spans`, a table in device memory, on `stream`. They return
// cudaErrorInvalidValue for arguments they cannot handle and cudaSuccess otherwise; the caller
// checks the launch itself (cudaGetLastError), as for any kernel launch.
//
// launch_cast converts `from` elements to `to` elements exactly as torch's CUDA Tensor.to does.
cudaError_t launch_cast(const Span* spans, int64_t count, Dtype from, Dtype to, cudaStream_t stream);
// launch_copy moves `word_bytes`-wide words (1, 2, 4, 8 or 16) unchanged: any dtype to itself.
cudaError_t launch_copy(const Span* spans, int64_t count, int word_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace zerofast
