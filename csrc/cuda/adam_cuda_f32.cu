// adam_kernel instantiations for float grads (one file per grad dtype so nvcc
// builds them in parallel).
#include "adam_cuda.cuh"

namespace zerokern {
namespace cuda {
template cudaError_t launch_adam<float, NoOut>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<float, __half>(const AdamBatch&, const AdamHyper&, cudaStream_t);
template cudaError_t launch_adam<float, __nv_bfloat16>(const AdamBatch&, const AdamHyper&, cudaStream_t);
}  // namespace cuda
}  // namespace zerokern
