// The emulated build's <cuda_runtime.h>: the SIMT emulator (../simt.h), which the build also
// force-includes, as nvcc force-includes the real one. This directory comes before the CUDA
// toolkit's on the include path, so the kernels' #include <cuda_runtime.h> lands here.
#pragma once
#include "../simt.h"
