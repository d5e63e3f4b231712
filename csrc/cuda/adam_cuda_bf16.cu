// adam_kernel instantiations for __nv_bfloat16 grads (one file per grad dtype so nvcc
// builds them in parallel).
#include "adam_cuda.cuh"

namespace zerokern {
namespace cuda {
template cudaError_t launch_adam<__nv_bfloat16, NoOut>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<__nv_bfloat16, __half>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<__nv_bfloat16, __nv_bfloat16>(const AdamBatch&, const AdamHyper&, cudaStream_t);
}  // namespace cuda
}  // namespace zerokern
