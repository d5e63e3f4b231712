#include "adam_cache.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace zerokern {
namespace {

// torch.Tensor and torch.nn.Parameter, the types whose objects are read directly.
bool is_plain_tensor(PyObject* obj) {
  static PyTypeObject* const tensor = [] {
    PyObject* torch = PyImport_ImportModule("torch");
    PyObject* type = torch ? PyObject_GetAttrString(torch, "Tensor") : nullptr;
    Py_XDECREF(torch);
    return reinterpret_cast<PyTypeObject*>(type);  // kept for the process' life
  }();
  static PyTypeObject* const parameter = [] {
    PyObject* nn = PyImport_ImportModule("torch.nn");
    PyObject* type = nn ? PyObject_GetAttrString(nn, "Parameter") : nullptr;
    Py_XDECREF(nn);
    return reinterpret_cast<PyTypeObject*>(type);
  }();
  if (tensor == nullptr || parameter == nullptr) {
    PyErr_Clear();
    return false;
  }
  return Py_TYPE(obj) == tensor || Py_TYPE(obj) == parameter;
}

uint64_t mix(uint64_t h, uint64_t w) {  // splitmix64 of the running hash and the word
  h ^= w + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27;
  return h;
}

// Three words per tensor: pointer, size, and dtype / device / contiguity.
// const_data_ptr: a mutable data_ptr would materialize a copy-on-write tensor.
void push_tensor(const at::Tensor& t, std::vector<int64_t>& words) {
  if (!t.defined()) {
    words.insert(words.end(), {0, 0, -1});
    return;
  }
  words.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.const_data_ptr())));
  words.push_back(t.numel());
  const c10::Device d = t.device();
  words.push_back(static_cast<int64_t>(t.scalar_type()) | static_cast<int64_t>(d.type()) << 8 |
                  static_cast<int64_t>(d.index() + 1) << 16 | static_cast<int64_t>(t.is_contiguous()) << 32);
}

// Dense CPU or CUDA memory the kernel may read and write as it is: no copy-on-write storage (the
// op's data_ptr() would copy it first), no flag that changes what the bits mean.
bool is_plain_storage(const at::Tensor& t) {
  if (t.layout() != at::kStrided || !t.has_storage() || !(t.is_cpu() || t.is_cuda())) return false;
  if (t.is_neg() || t.is_conj() || t._is_zerotensor()) return false;
  if (t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize})))
    return false;
  return !c10::impl::cow::is_cow_data_ptr(t.storage().data_ptr());
}

void finish(TensorListsKey& key) {
  uint64_t h = 0;
  for (const int64_t w : key.words) h = mix(h, static_cast<uint64_t>(w));
  key.hash = h;
}

// A Python None or plain tensor as an optional tensor; false for anything else.
bool optional_tensor(PyObject* obj, std::optional<at::Tensor>& out) {
  if (obj == Py_None) return true;
  if (!is_plain_tensor(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

// The entry with `key` in a most-recent-last list, moved last; nullptr if there is none.
template <typename Entries, typename KeyOf>
typename Entries::value_type* touch(Entries& entries, const TensorListsKey& key, KeyOf key_of) {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (key_of(*it) == key) {
      std::rotate(std::next(it).base(), std::next(it).base() + 1, entries.end());
      return &entries.back();
    }
  }
  return nullptr;
}

// torch's mapping of c10 errors to Python exceptions, for the errors the checks raise.
PyObject* raise(PyObject* type, const char* message) {
  PyErr_SetString(type, message);
  return nullptr;
}

}  // namespace

TensorListsKey key_of(std::initializer_list<at::TensorList> lists) {
  TensorListsKey key;
  size_t n = 0;
  for (const at::TensorList& l : lists) n += l.size();
  key.words.reserve(lists.size() + 3 * n);
  for (const at::TensorList& l : lists) key.words.push_back(static_cast<int64_t>(l.size()));
  for (const at::TensorList& l : lists)
    for (const at::Tensor& t : l) push_tensor(t, key.words);
  finish(key);
  return key;
}

bool key_of_python(PyObject* lists, TensorListsKey& key) {
  if (!PyTuple_Check(lists)) return false;
  const Py_ssize_t count = PyTuple_GET_SIZE(lists);
  Py_ssize_t n = 0;
  for (Py_ssize_t j = 0; j < count; ++j) {
    PyObject* l = PyTuple_GET_ITEM(lists, j);
    if (!PyList_Check(l)) return false;
    n += PyList_GET_SIZE(l);
  }
  key.words.clear();
  key.words.reserve(count + 3 * n);
  for (Py_ssize_t j = 0; j < count; ++j) key.words.push_back(PyList_GET_SIZE(PyTuple_GET_ITEM(lists, j)));
  for (Py_ssize_t j = 0; j < count; ++j) {
    PyObject* l = PyTuple_GET_ITEM(lists, j);
    for (Py_ssize_t i = 0, size = PyList_GET_SIZE(l); i < size; ++i) {
      PyObject* obj = PyList_GET_ITEM(l, i);
      if (!is_plain_tensor(obj)) return false;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!is_plain_storage(t)) return false;
      push_tensor(t, key.words);
    }
  }
  finish(key);
  return true;
}

std::shared_ptr<const AdamArraysCache::Entry> AdamArraysCache::find(const TensorListsKey& key) {
  const std::lock_guard<std::mutex> lock(mutex_);
  return find_locked(key);
}

std::shared_ptr<const AdamArraysCache::Entry> AdamArraysCache::find_locked(const TensorListsKey& key) {
  const auto key_of_entry = [](const std::shared_ptr<const Entry>& e) -> const TensorListsKey& { return e->key; };
  const std::shared_ptr<const Entry>* hit = touch(entries_, key, key_of_entry);
  return hit ? *hit : nullptr;
}

void AdamArraysCache::remember(TensorListsKey key, AdamArrays arrays, c10::Device device) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (find_locked(key)) return;
  if (entries_.size() == kEntries) entries_.erase(entries_.begin());
  entries_.push_back(std::make_shared<const Entry>(Entry{std::move(key), std::move(arrays), device}));
}

PyObject* fused_adam_cached(PyObject* args, AdamArraysCache& cache, AdamRunner run, bool release_gil) {
  PyObject *lists, *lr_obj, *step_obj, *scale_obj, *found_obj, *adam_w_obj, *bias_obj, *dry_obj;
  double lr, beta1, beta2, eps, weight_decay, step, grad_scale;
  // Booleans as the op's schema takes them: True or False, nothing else.
  if (!PyArg_ParseTuple(args, "OddddddO!O!dOOOOO!", &lists, &lr, &beta1, &beta2, &eps, &weight_decay, &step,
                        &PyBool_Type, &adam_w_obj, &PyBool_Type, &bias_obj, &grad_scale, &lr_obj, &step_obj,
                        &scale_obj, &found_obj, &PyBool_Type, &dry_obj))
    return nullptr;
  const bool adam_w_mode = adam_w_obj == Py_True, bias_correction = bias_obj == Py_True;
  const bool dry_run = dry_obj == Py_True;
  try {
    // Modes must see the op (a profiler's, FakeTensor's, a user's logging mode).
    if (c10::impl::dispatch_mode_enabled() || at::impl::torch_function_mode_enabled()) Py_RETURN_FALSE;
    std::optional<at::Tensor> lr_t, step_t, scale_t, found_inf;
    TensorListsKey key;
    if (!optional_tensor(lr_obj, lr_t) || !optional_tensor(step_obj, step_t) ||
        !optional_tensor(scale_obj, scale_t) || !optional_tensor(found_obj, found_inf) ||
        !key_of_python(lists, key))
      Py_RETURN_FALSE;
    const std::shared_ptr<const AdamArraysCache::Entry> entry = cache.find(key);
    if (!entry) Py_RETURN_FALSE;
    RECORD_FUNCTION("zerokern::fused_adam_ (cached)", std::vector<c10::IValue>());
    AdamHyper h;
    check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale,
                     step_t.has_value(), scale_t.has_value(), h);
    check_adam_scalar_tensors(lr_t, step_t, scale_t, found_inf, entry->device, h);
    if (dry_run) Py_RETURN_TRUE;
    if (!release_gil) {
      run(entry->arrays, h, entry->device);
      Py_RETURN_TRUE;
    }
    // As torch.ops calls do, other Python threads (a data loader) run while the update does;
    // and as the op's argument stack does, references keep the tensors alive meanwhile, should
    // another thread drop them from the lists. `entry` keeps the arrays alive if evicted.
    std::vector<PyObject*> held;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(lists); ++j) {
      PyObject* copy = PyList_GetSlice(PyTuple_GET_ITEM(lists, j), 0, PY_SSIZE_T_MAX);
      if (copy == nullptr) {
        for (PyObject* o : held) Py_DECREF(o);
        return nullptr;
      }
      held.push_back(copy);
    }
    PyThreadState* state = PyEval_SaveThread();
    try {
      run(entry->arrays, h, entry->device);
    } catch (...) {
      PyEval_RestoreThread(state);
      for (PyObject* o : held) Py_DECREF(o);
      throw;
    }
    PyEval_RestoreThread(state);
    for (PyObject* o : held) Py_DECREF(o);
  } catch (const c10::TypeError& e) {
    return raise(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    return raise(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return raise(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return raise(PyExc_RuntimeError, e.what());
  }
  Py_RETURN_TRUE;
}

PyObject* tensor_lists_id(PyObject* lists) {
  struct Known {
    TensorListsKey key;
    uint64_t id;
  };
  static std::vector<Known> known;  // most recent last; the GIL guards it
  static uint64_t next_id = 1;
  constexpr size_t kKnown = 64;
  TensorListsKey key;
  try {
    if (!key_of_python(lists, key)) Py_RETURN_NONE;
  } catch (const std::exception& e) {
    return raise(PyExc_RuntimeError, e.what());
  }
  if (const Known* hit = touch(known, key, [](const Known& k) -> const TensorListsKey& { return k.key; }))
    return PyLong_FromUnsignedLongLong(hit->id);
  if (known.size() == kKnown) known.erase(known.begin());
  known.push_back(Known{std::move(key), next_id++});
  return PyLong_FromUnsignedLongLong(known.back().id);
}

}  // namespace zerokern
