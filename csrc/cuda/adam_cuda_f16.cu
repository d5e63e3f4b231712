// adam_kernel instantiations for __half grads (one file per grad dtype so nvcc
// builds them in parallel).
#include "adam_cuda.cuh"

namespace zerokern {
namespace cuda {
template cudaError_t launch_adam<__half, NoOut>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<__half, __half>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<__half, __nv_bfloat16>(const AdamBatch&, const AdamHyper&, cudaStream_t);
}  // namespace cuda
}  // namespace zerokern
