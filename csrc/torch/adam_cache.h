// The host side of a cached fused_adam_ call: validation done once per set of
// tensors, reused while the same tensors come back.
//
// [Note: host cost]
// A training loop calls fused_adam_ with the same tensors every step. Through
// the dispatcher a call converts every tensor of five lists to an IValue and
// checks each one again: 0.64 us per parameter on the CI CPU, 1.9 ms for 3,000
// parameters, more than the update of a small model takes on a GPU. So the
// eager path first asks fused_adam_cached (a plain Python function, no
// dispatcher): it reads the Python lists directly and builds a TensorListsKey,
// everything check_adam_tensors' verdict depends on (each tensor's data
// pointer, size, dtype, device, contiguity). A key seen before, from a call
// that passed validation, means the same verdict: the validated pointer arrays
// are reused and only the numbers and one-element tensors are checked. Any
// other call (a new key, an element that is not a plain tensor) returns False
// and goes through the op, which validates everything and remembers the key.
// The pointers of a cached entry are used only while a call passes tensors
// with exactly those pointers, and the call holds references to the tensor
// objects while the update runs, as the op's argument stack does.
// Where the op would do more than run the kernel, the cached path declines:
// under a TorchDispatchMode or TorchFunctionMode (they must see the op), for
// copy-on-write storage (the op materializes it first), and for tensors with
// a dispatch flag the kernel ignores (negative / conjugate views, zero
// tensors). The profiler sees "zerokern::fused_adam_ (cached)".
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op): 4x the parse time of each file (docs/build.md)

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <vector>

#include "adam_args.h"

namespace zerokern {

// What check_adam_tensors' verdict depends on, for all five lists.
struct TensorListsKey {
  std::vector<int64_t> words;
  uint64_t hash = 0;
  bool operator==(const TensorListsKey& other) const { return hash == other.hash && words == other.words; }
};

// From the op's (validated) arguments.
TensorListsKey key_of(std::initializer_list<at::TensorList> lists);
// From a tuple of Python lists. False where an element is not a plain tensor (torch.Tensor or
// nn.Parameter, strided, with storage): subclasses and the like take the op's path.
bool key_of_python(PyObject* lists, TensorListsKey& key);

// The validated arrays of the last few distinct calls (a model has a few dtype groups and
// buckets), most recent last. The op remembers without the GIL (torch.ops calls release it),
// so a mutex guards the entries.
class AdamArraysCache {
 public:
  struct Entry {
    TensorListsKey key;
    AdamArrays arrays;
    c10::Device device;
  };
  std::shared_ptr<const Entry> find(const TensorListsKey& key);
  void remember(TensorListsKey key, AdamArrays arrays, c10::Device device);

 private:
  std::shared_ptr<const Entry> find_locked(const TensorListsKey& key);
  static constexpr size_t kEntries = 32;
  std::mutex mutex_;
  std::vector<std::shared_ptr<const Entry>> entries_;
};

// Runs the update on the device (the CPU kernel, or a CUDA launch on the current stream).
using AdamRunner = void (*)(const AdamArrays& arrays, AdamHyper& hyper, const c10::Device& device);

// The Python function fused_adam_cached(lists, lr, beta1, beta2, eps, weight_decay, step,
// adam_w_mode, bias_correction, grad_scale, lr_tensor, step_tensor, grad_scale_tensor,
// found_inf, dry_run) -> bool: True when it ran (or, with dry_run, would have run: everything
// but the update, for bench/host_overhead.py), False when the op must be called instead.
// release_gil: for a runner that does the work (the CPU kernel), not for one that only launches.
PyObject* fused_adam_cached(PyObject* args, AdamArraysCache& cache, AdamRunner run, bool release_gil);

// The Python function tensor_lists_id(lists) -> int or None: a number that stands for the key
// of these lists (the Triton backend's cache key, see triton_adam.py). Numbers are never
// reused: a key forgotten and seen again gets a new one, so equal numbers mean equal keys.
// None where key_of_python says no.
PyObject* tensor_lists_id(PyObject* lists);

}  // namespace zerokern
