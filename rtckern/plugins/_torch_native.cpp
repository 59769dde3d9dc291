// The native front of rtckern's torch ops: a C++ kernel at AutogradCUDA that replays a call's launches without
// entering Python.
//
// A torch.ops.rtckern call registered from Python costs the dispatcher boxing every argument into a Python kernel
// (~10 us on an H200 host, more than torch's own call); torch's ops are C++ kernels. Here one boxed kernel serves
// every registered op. For a call that needs no gradient, has plain dense CUDA tensors (no subclass, mode or
// functorch layer) and 16-byte aligned inputs, it builds a key of the arguments (dtypes, devices, shapes, strides
// and every scalar) and looks up a recipe: the outputs' shapes, strides and dtypes, and the call's launches (function,
// context, grid, block, shared memory, and each parameter as a constant, an input's, an output's or a workspace's
// address). A hit allocates the outputs and workspaces through torch and launches on torch's current stream.
//
// A miss calls the op's recorder twin (rtckern::_native_record_<op>, registered by _torch_native.py), which runs the
// op's Python implementation while watching it: when the call only allocated its outputs and workspaces, zeroed some
// of them and made prepared launches whose addresses are its inputs', outputs' and workspaces', it offers those steps
// here (rtk_offer) and they become the key's recipe; otherwise the key is marked so and later calls skip the
// recording. Every other call (a gradient needed, tracing, fake tensors, modes, misaligned inputs, a refused key)
// goes to the Python kernels as before, by redispatching to AutogradOther, where the op's Python autograd (or
// composite) kernel is registered.
//
// The same kernel sits at the CUDA key for calls that reach it without the autograd keys (torch.inference_mode(),
// redispatches below autograd); what it does not serve there goes to the op's Python implementation (its python twin,
// rtckern::_native_python_<op>).
//
// Built at first use by _torch_native.py with the system C++ compiler against the installed torch's headers and
// loaded with dlopen (ctypes); it calls the driver through entry points found in the process's libcuda (rtk_init), as
// runtime/native_launch.c does.
#ifdef RTK_DIRECT  // the direct entry (below) takes and returns Python objects: built where Python's headers are
#include <torch/csrc/autograd/python_variable.h>  // (Python.h first: it includes it)

#include <ATen/PythonTorchFunctionTLS.h>
#endif
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zero.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using launch_fn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                          void**);
using launch_ex_fn = int (*)(const void*, void*, void**, void**);
using ctx_get_fn = int (*)(void**);
using ctx_push_fn = int (*)(void*);
using ctx_pop_fn = int (*)(void**);
using replace_address_fn = int (*)(void*, void*);

launch_fn cu_launch = nullptr;
launch_ex_fn cu_launch_ex = nullptr;
ctx_get_fn cu_ctx_get = nullptr;
ctx_push_fn cu_ctx_push = nullptr;
ctx_pop_fn cu_ctx_pop = nullptr;
replace_address_fn cu_tensor_map_replace_address = nullptr;  // CUDA 12+: recipes with tensor maps need it

constexpr int kMaxParams = 48;
constexpr int kBlockBytes = 2048;
constexpr int kAttrProgrammaticStreamSerialization = 6;

// cuda.h's CUlaunchAttribute and CUlaunchConfig, laid out alike (as in native_launch.c)
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int allowed;
    void* align;
  } value;
};
struct LaunchConfig {
  unsigned grid[3], block[3], smem;
  void* stream;
  LaunchAttribute* attrs;
  unsigned nattrs;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute");
static_assert(sizeof(LaunchConfig) == 56, "CUlaunchConfig");

enum Source : uint8_t { kConst = 0, kInput = 1, kOutput = 2, kTemp = 3 };

struct Param {
  char kind;
  uint8_t source;
  int16_t index;  // the argument (kInput), output (kOutput) or workspace (kTemp) whose address is passed
  int offset;     // in the parameter block
  uint64_t bits;  // kConst: the value's bytes; kOutput, kTemp: a byte offset from the start of the buffer
  std::shared_ptr<const std::array<unsigned char, 128>> map;  // 'M': the tensor map, its address replaced per call
};

struct Launch {
  void* func = nullptr;
  void* ctx = nullptr;
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1}, smem = 0;
  int dependent = 0;
  std::vector<Param> params;
  std::string label;
};

struct Output {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
};

// One step of a recipe, in the order the Python path took them: a launch, or zeroing an output or a workspace.
struct Step {
  char kind = 'L';  // 'L' launch, 'Z' zero
  uint8_t source = kTemp;
  int16_t index = 0;
  Launch launch;
};

struct Recipe {
  bool refused = false;  // the recorder could not describe the call: later calls take the Python kernels
  int attempts = 1;      // recordings refused so far: a signature is recorded twice before it stays refused (a first
                         // call of the process may run one-off work: probes, compiles)
  std::vector<Output> outputs;
  std::vector<int64_t> temps;  // workspaces: bytes, allocated per call through torch and released after it
  std::vector<Step> steps;
};

// The ops whose gradient formula is also written here (rtk_register_grad), so that a call needing a gradient makes a
// C++ autograd node instead of a Python autograd.Function; each mirrors its Python formula (named at grad_call).
enum Formula : uint8_t {
  kNoFormula = 0, kRmsNorm = 1, kAddRmsNorm = 2, kLayerNorm = 3, kAttention = 4, kSoftmax = 5, kSwiglu = 6,
  kRope = 7, kCrossEntropy = 8, kAttentionVarlen = 9
};

struct OpState {
  c10::OperatorHandle recorder;
  c10::OperatorHandle python;  // the op's Python implementation, for what the backend kernel does not replay
  std::unordered_map<std::string, std::shared_ptr<const Recipe>> recipes;
  std::atomic<uint8_t> formula{kNoFormula};  // set once by rtk_register_grad, after the three handles below
  // the op itself, its backward op, and the op that recomputes statistics the forward did not return
  std::optional<c10::OperatorHandle> self, backward, recompute;
  OpState(c10::OperatorHandle r, c10::OperatorHandle p) : recorder(std::move(r)), python(std::move(p)) {}
};

std::shared_mutex table_mutex;
std::unordered_map<std::string, std::unique_ptr<OpState>> ops;  // by the op's qualified name
size_t recipe_count = 0;
uint64_t generation = 0;  // bumped by rtk_clear: a recording that started before a clear is not stored
thread_local bool bypass = false;  // rtk_bypass: this thread's calls take the Python kernels (reference_mode)
thread_local bool grad_bypass = false;  // rtk_grad_bypass: this thread's gradients take the Python autograd.Function
c10::DeviceType replay_device = c10::DeviceType::CUDA;  // CPU only in the CPU tests (rtk_test_device)

// The key being recorded by this thread (between the miss and the recorder's return) and what it offered.
struct Pending {
  bool active = false;
  bool offered = false;
  bool skipped = false;  // the recorder could not watch this call (another thread was recording): learn it later
  std::vector<int64_t> temps;
  std::vector<Step> steps;
};
thread_local Pending pending;

int kind_size(char k) {
  switch (k) {
    case 'P': case 'q': case 'd': return 8;
    case 'i': case 'I': case 'f': return 4;
    case 'M': return 128;  // a CUtensorMap, 64-byte aligned
    default: return 0;
  }
}

int kind_align(char k) { return k == 'M' ? 64 : kind_size(k); }

// Keys present in a tensor or in the thread's included set that send the call to the Python kernels: subclasses and
// fake tensors (Python), dispatch modes (Python, PythonTLSSnapshot), functorch, functionalization, lazy conj / neg.
const c10::DispatchKeySet kNotPlain = c10::DispatchKeySet({
    c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchDynamicLayerBackMode,
    c10::DispatchKey::Functionalize, c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
    c10::DispatchKey::ZeroTensor, c10::DispatchKey::PreDispatch});

void put(std::string& k, const void* p, size_t n) { k.append(static_cast<const char*>(p), n); }

// The call's key, or false when the call cannot be replayed (then it goes to the Python kernels). Also says whether
// every tensor argument is 16-byte aligned and the device index of the first.
bool call_key(const torch::jit::Stack& stack, size_t first, size_t n, std::string& key, bool& aligned, int& device) {
  const bool grad = c10::GradMode::is_enabled();
  aligned = true;
  device = -1;
  bool tensors = false;
  // the tensor arguments so far (storage, address): which ones share a storage, and at what byte distance, is part of
  // the key (views of one buffer, such as q, k, v split from a fused projection, replay only for calls laid out alike)
  const void* seen_storage[64];
  uintptr_t seen_ptr[64];
  int nseen = 0;
  key.clear();
  for (size_t i = first; i < first + n; ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        key.push_back('u');
        continue;
      }
      if (t.device().type() != replay_device || t.layout() != c10::kStrided || t.key_set().has_any(kNotPlain) ||
          t.is_nested() || (grad && t.requires_grad()))
        return false;
      const int idx = t.device().index();  // -1 for the CPU tests' tensors
      if (!tensors) {
        device = idx;
        const int16_t d = static_cast<int16_t>(idx);  // the recipe's functions and context belong to one device
        key.push_back('D');
        put(key, &d, 2);
      } else if (idx != device) {
        return false;
      }
      tensors = true;
      const uintptr_t ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
      const void* storage = t.storage().unsafeGetStorageImpl();
      if (ptr & 15) aligned = false;
      int8_t share = -1;  // the first earlier tensor argument of the same storage
      for (int j = 0; j < nseen && share < 0; ++j)
        if (seen_storage[j] == storage) share = static_cast<int8_t>(j);
      if (nseen == 64) return false;
      put(key, &share, 1);
      // the address mod 32: a path that needs 32-byte alignment (quantize_fp8 on fp32 groups of 256) learns and
      // refuses 16-mod-32 addresses under their own key
      const uint8_t mod32 = static_cast<uint8_t>(ptr & 31);
      put(key, &mod32, 1);
      if (share >= 0) {
        const int64_t distance = static_cast<int64_t>(ptr - seen_ptr[share]);
        put(key, &distance, 8);
      }
      seen_storage[nseen] = storage;
      seen_ptr[nseen++] = ptr;
      const int8_t dt = static_cast<int8_t>(t.scalar_type());
      const int64_t dim = t.dim();
      key.push_back('t');
      put(key, &dt, 1);
      put(key, &dim, 8);
      put(key, t.sizes().data(), 8 * dim);
      put(key, t.strides().data(), 8 * dim);
    } else if (v.isNone()) {
      key.push_back('n');
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      key.push_back('d');
      put(key, &d, 8);
    } else if (v.isInt()) {
      const int64_t x = v.toInt();
      key.push_back('i');
      put(key, &x, 8);
    } else if (v.isBool()) {
      key.push_back(v.toBool() ? 'T' : 'F');
    } else if (v.isString()) {
      const auto& s = v.toStringRef();
      const int64_t len = static_cast<int64_t>(s.size());
      key.push_back('s');
      put(key, &len, 8);
      key.append(s);
    } else {
      return false;  // lists, SymInts and the rest: the Python kernels
    }
  }
  return tensors;
}

// A replayed launch failed (the driver's launch, a context push or a tensor map's address): serve() hands the call
// to the Python path, whose own launch reports the failure as rtckern's LaunchError.
struct LaunchFailure : std::exception {};

// Test hook (CPU tests): a function called per replayed launch with the parameter pointers, instead of the driver;
// it returns what the driver would (0: launched).
using test_launch_fn = int (*)(const char* label, int nparams, void** params);
test_launch_fn test_launch = nullptr;

void launch_or_throw(const Launch& l, const torch::jit::Stack& stack, size_t first, const std::vector<at::Tensor>& outs,
                     const std::vector<at::Tensor>& temps, void* stream) {
  alignas(64) unsigned char block[kBlockBytes];
  void* params[kMaxParams];
  for (size_t i = 0; i < l.params.size(); ++i) {
    const Param& p = l.params[i];
    uint64_t bits = p.bits;
    if (p.source == kInput) {
      const at::Tensor& t = stack[first + p.index].toTensor();
      bits = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
    } else if (p.source == kOutput) {
      bits += reinterpret_cast<uint64_t>(outs[p.index].data_ptr());
    } else if (p.source == kTemp) {
      bits += reinterpret_cast<uint64_t>(temps[p.index].data_ptr());
    }
    params[i] = block + p.offset;
    if (p.kind == 'M') {
      std::memcpy(block + p.offset, p.map->data(), 128);
      const int err = cu_tensor_map_replace_address(block + p.offset, reinterpret_cast<void*>(bits));
      if (err != 0) throw LaunchFailure();
    } else {
      std::memcpy(block + p.offset, &bits, kind_size(p.kind));  // little-endian: the low bytes for 4-byte kinds
    }
  }
  if (test_launch != nullptr) {
    const int err = test_launch(l.label.c_str(), static_cast<int>(l.params.size()), params);
    if (err != 0) throw LaunchFailure();
    return;
  }
  void* cur = nullptr;
  int err = cu_ctx_get(&cur), pushed = 0;
  if (err == 0 && cur != l.ctx) {
    err = cu_ctx_push(l.ctx);
    pushed = err == 0;
  }
  if (err == 0 && l.dependent && cu_launch_ex != nullptr) {
    LaunchAttribute attr;
    std::memset(&attr, 0, sizeof attr);
    attr.id = kAttrProgrammaticStreamSerialization;
    attr.value.allowed = 1;
    LaunchConfig cfg = {{l.grid[0], l.grid[1], l.grid[2]}, {l.block[0], l.block[1], l.block[2]}, l.smem, stream,
                        &attr, 1};
    err = cu_launch_ex(&cfg, l.func, params, nullptr);
  } else if (err == 0) {
    err = cu_launch(l.func, l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2], l.smem, stream,
                    params, nullptr);
  }
  if (pushed) {
    void* popped;
    cu_ctx_pop(&popped);
  }
  if (err != 0) throw LaunchFailure();
}

void replay(const Recipe& r, torch::jit::Stack& stack, size_t first, size_t n, int device) {
  const auto opts = at::TensorOptions().device(c10::Device(replay_device, static_cast<c10::DeviceIndex>(device)));
  std::vector<at::Tensor> outs;
  outs.reserve(r.outputs.size());
  for (const Output& o : r.outputs) outs.push_back(at::empty_strided(o.sizes, o.strides, opts.dtype(o.dtype)));
  std::vector<at::Tensor> temps;
  temps.reserve(r.temps.size());
  for (int64_t bytes : r.temps) temps.push_back(at::empty({bytes}, opts.dtype(at::kByte)));
  void* stream = nullptr;
  if (replay_device == c10::DeviceType::CUDA) {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    stream = impl.getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle();
  }
  for (const Step& s : r.steps) {
    if (s.kind == 'Z') {
      at::AutoDispatchBelowADInplaceOrView below;  // fresh buffers: no autograd or version bookkeeping to do
      at::zero_(s.source == kOutput ? outs[s.index] : temps[s.index]);
      continue;
    }
    launch_or_throw(s.launch, stack, first, outs, temps, stream);
  }
  torch::jit::drop(stack, n);
  for (auto& t : outs) stack.emplace_back(std::move(t));
}

// A replay of recipe under key failed to launch: the key is refused for good (unless it was cleared or relearned).
void refuse_after_failure(OpState* state, const std::string& key, const std::shared_ptr<const Recipe>& recipe) {
  auto refused = std::make_shared<Recipe>();
  refused->refused = true;
  refused->attempts = 2;
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  auto slot = state->recipes.find(key);
  if (slot != state->recipes.end() && slot->second == recipe) slot->second = std::move(refused);
}

// Replay or record the call; false when it is not served here (the caller takes the Python kernels), with state set
// to the op's state where it is registered.
bool serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpState*& state) {
  state = nullptr;
  const size_t n = op.schema().arguments().size();
  const size_t first = stack->size() - n;
  std::string key;
  bool aligned = false;
  int device = -1;  // of the tensor arguments (one device)
  const bool plain = !bypass && !c10::impl::tls_local_dispatch_key_set().included_.has_any(kNotPlain) &&
                     call_key(*stack, first, n, key, aligned, device);
  if (plain) {
    std::shared_ptr<const Recipe> recipe;
    uint64_t started = 0;
    {
      std::shared_lock<std::shared_mutex> lock(table_mutex);
      started = generation;
      auto it = ops.find(op.schema().name());
      if (it != ops.end()) {
        state = it->second.get();
        auto r = state->recipes.find(key);
        if (r != state->recipes.end()) recipe = r->second;
      }
    }
    // (a key holds each address mod 32 and only aligned calls are recorded: a hit's addresses are 16-byte aligned)
    if (recipe && !recipe->refused) {
      try {
        replay(*recipe, *stack, first, n, device);  // (the arguments stay on the stack until it succeeds)
        return true;
      } catch (const LaunchFailure&) {
        // a launch failed: the signature goes back to the Python path, which runs the call again and reports a
        // failure in its own terms (rtckern's LaunchError); other errors (out of memory) propagate as they are
        refuse_after_failure(state, key, recipe);
        return false;
      }
    } else if ((!recipe || recipe->attempts < 2) && state != nullptr && aligned) {
      // record: the recorder twin runs the Python implementation and may offer its launches (rtk_offer)
      pending = Pending{};
      pending.active = true;
      struct Reset {
        ~Reset() { pending = Pending{}; }
      } reset;
      state->recorder.callBoxed(stack);
      if (pending.skipped) return true;
      auto r = std::make_shared<Recipe>();
      const size_t nret = op.schema().returns().size();
      bool ok = pending.offered && stack->size() >= nret;
      for (size_t j = 0; ok && j < nret; ++j) {
        const c10::IValue& v = (*stack)[stack->size() - nret + j];
        if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().device().type() != replay_device) {
          ok = false;
          break;
        }
        const at::Tensor& t = v.toTensor();
        if (t.device().index() != device) {
          ok = false;
          break;
        }
        r->outputs.push_back(Output{t.sizes().vec(), t.strides().vec(), t.scalar_type()});
      }
      if (ok) {
        r->temps = std::move(pending.temps);
        r->steps = std::move(pending.steps);
        const auto& args = op.schema().arguments();
        const auto in_range = [&](uint8_t source, int16_t index) {
          return source == kOutput ? index < static_cast<int16_t>(nret)
                                   : index < static_cast<int16_t>(r->temps.size());
        };
        for (const Step& s : r->steps) {
          if (s.kind == 'Z' && !in_range(s.source, s.index)) ok = false;
          if (s.kind != 'L') continue;
          for (const Param& p : s.launch.params) {
            if (p.source == kInput) {  // an argument of a tensor type (the value may be None: address 0)
              const auto kind = p.index < static_cast<int>(n) ? args[p.index].type()->kind() : c10::TypeKind::AnyType;
              const bool tensor = kind == c10::TypeKind::TensorType ||
                                  (kind == c10::TypeKind::OptionalType &&
                                   args[p.index].type()->containedType(0)->kind() == c10::TypeKind::TensorType);
              if (!tensor) ok = false;
            }
            if ((p.source == kOutput || p.source == kTemp) && !in_range(p.source, p.index)) ok = false;
          }
        }
      }
      if (!ok) {
        r->outputs.clear();
        r->temps.clear();
        r->steps.clear();
        r->refused = true;
      }
      std::unique_lock<std::shared_mutex> lock(table_mutex);
      if (generation != started) return true;  // cleared meanwhile: the recording may describe unloaded functions
      auto it = ops.find(op.schema().name());
      if (it == ops.end()) return true;
      auto& slot = it->second->recipes[key];
      if (slot && !slot->refused) return true;  // another thread's recording of the key was stored meanwhile: keep it
      if (r->refused) r->attempts = slot ? slot->attempts + 1 : 1;
      if (!slot) ++recipe_count;
      slot = std::move(r);
      return true;
    }
  }
  return false;
}

#ifdef RTK_DIRECT
// ---- direct calls: rtckern.ops' own functions ----------------------------------------------------------------------
// rtckern.ops.softmax and its kin are Python functions (they take CuPy arrays too); a call of one with torch tensors
// costs its Python path: a memo key, a plan lookup, an allocation and a prepared launch, 1.1-1.2x torch's own call
// for softmax. (rtckern.torch's rms_norm / layer_norm entry points call it too.) Where the ops layer binds one of its
// functions to the torch op of the same arguments and results
// (rtk_direct_bind, a slot per function), the function first hands its arguments to direct_call: one C call that
// converts them by the op's schema, builds the key serve() builds and replays the recipe, skipping the Python path,
// the dispatcher and torch.ops' Python layer. A key not learned yet is called through the dispatcher (which records
// it, with torch's fallback off: an unsupported request raises, as the function does); anything else (not a plain
// torch tensor or Parameter, a torch function mode, a gradient needed, a refused key, an error) returns None, and the
// function runs its Python path, which raises its own errors. KeyboardInterrupt and other BaseExceptions propagate.
constexpr int kDirectSlots = 64;

struct DirectOp {
  OpState* state;
  c10::OperatorHandle handle;
  // per argument: 'T' tensor, 't' optional tensor, 'f' float, 'b' bool, 'i' int, 's' string, 'n' another optional
  // (passed as None only)
  std::string kinds;
  size_t rets;
};
std::array<std::atomic<const DirectOp*>, kDirectSlots> direct_ops{};  // bound once each, kept for the process
// This thread's direct_call is calling its op through the dispatcher: the op's Python implementation then raises an
// unsupported request instead of serving it with torch's implementation, as the function it stands for would (the
// plugin asks rtk_direct_dispatching when it is about to fall back).
thread_local bool direct_dispatching = false;

// The Python value o as the schema's kind k on the stack; false when it is not of that kind (the call is not served).
bool push_direct(char k, PyObject* o, torch::jit::Stack& stack) {
  switch (k) {
    case 't':
      if (o == Py_None) {
        stack.emplace_back();
        return true;
      }
      [[fallthrough]];
    case 'T':  // a plain tensor or a Parameter (a subclass may override torch functions the Python path calls)
      if (!THPVariable_CheckExact(o)) return false;
      stack.emplace_back(THPVariable_Unpack(o));
      return true;
    case 'f':  // a float, or an int as the dispatcher converts it (a bool is refused, as torch's schema parser does)
      if (PyFloat_Check(o)) {
        stack.emplace_back(PyFloat_AS_DOUBLE(o));
        return true;
      }
      if (PyLong_CheckExact(o)) {
        const double v = PyLong_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
        stack.emplace_back(v);
        return true;
      }
      return false;
    case 'b':
      if (!PyBool_Check(o)) return false;
      stack.emplace_back(o == Py_True);
      return true;
    case 's': {
      if (!PyUnicode_CheckExact(o)) return false;
      Py_ssize_t len = 0;
      const char* text = PyUnicode_AsUTF8AndSize(o, &len);
      if (text == nullptr) {
        PyErr_Clear();
        return false;
      }
      stack.emplace_back(std::string(text, static_cast<size_t>(len)));
      return true;
    }
    case 'n':
      if (o != Py_None) return false;
      stack.emplace_back();
      return true;
    case 'i': {
      if (!PyLong_CheckExact(o)) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      stack.emplace_back(static_cast<int64_t>(v));
      return true;
    }
    default:
      return false;
  }
}

// The last n values of stack (the op's results, all tensors) as one tensor or a tuple.
PyObject* direct_results(torch::jit::Stack& stack, size_t n) {
  const size_t first = stack.size() - n;
  if (n == 1) return THPVariable_Wrap(std::move(stack[first]).toTensor());
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (out == nullptr) return nullptr;
  for (size_t j = 0; j < n; ++j) {
    PyObject* t = THPVariable_Wrap(std::move(stack[first + j]).toTensor());
    if (t == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(j), t);
  }
  return out;
}

// The Python error behind a failed call (a Python exception inside the dispatcher's Python kernels arrives as one
// of these C++ exceptions): true when it may be dropped (an Exception: the Python path raises its own), false for a
// BaseException that must propagate (KeyboardInterrupt, SystemExit), which is then set as this thread's error.
bool droppable(pybind11::error_already_set& e) {
  if (e.matches(PyExc_Exception)) return true;
  e.restore();
  return false;
}

struct DirectDispatch {  // direct_dispatching for one dispatcher call
  DirectDispatch() { direct_dispatching = true; }
  ~DirectDispatch() { direct_dispatching = false; }
};

PyObject* direct_results_or_none(torch::jit::Stack& stack, size_t rets) {
  if (stack.size() != rets) Py_RETURN_NONE;
  for (const auto& v : stack)
    if (!v.isTensor()) Py_RETURN_NONE;
  return direct_results(stack, rets);
}

// direct(slot, *args): the results of the op bound to slot for args (every argument, in its schema's order), or None
// where the call is not served here.
PyObject* direct_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  // (a recording in this thread runs the op's Python path, which calls its function: that call must run in Python)
  if (nargs < 1 || bypass || pending.active || direct_dispatching || !PyLong_CheckExact(args[0])) Py_RETURN_NONE;
  const long slot = PyLong_AsLong(args[0]);
  if (slot < 0 || slot >= kDirectSlots) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  const DirectOp* d = direct_ops[slot].load(std::memory_order_acquire);
  if (d == nullptr || static_cast<size_t>(nargs - 1) != d->kinds.size() || at::impl::torch_function_mode_enabled())
    Py_RETURN_NONE;
  // torch.jit.trace must see the op, not the replay's allocations (serve() runs below the tracer, which excludes it)
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Tracer) &&
      !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Tracer))
    Py_RETURN_NONE;
  try {
    const size_t n = d->kinds.size();
    torch::jit::Stack stack;
    stack.reserve(n + d->rets);
    for (size_t i = 0; i < n; ++i)
      if (!push_direct(d->kinds[i], args[i + 1], stack)) Py_RETURN_NONE;
    std::string key;
    bool aligned = false;
    int device = -1;
    if (c10::impl::tls_local_dispatch_key_set().included_.has_any(kNotPlain) ||
        !call_key(stack, 0, n, key, aligned, device))
      Py_RETURN_NONE;
    std::shared_ptr<const Recipe> recipe;
    {
      std::shared_lock<std::shared_mutex> lock(table_mutex);
      auto r = d->state->recipes.find(key);
      if (r != d->state->recipes.end()) recipe = r->second;
    }
    if (recipe && !recipe->refused) {  // (its addresses are aligned: see serve())
      try {
        replay(*recipe, stack, 0, n, device);
      } catch (const LaunchFailure&) {
        refuse_after_failure(d->state, key, recipe);
        Py_RETURN_NONE;
      }
      return direct_results(stack, d->rets);
    }
    if (!aligned || (recipe && recipe->attempts >= 2)) Py_RETURN_NONE;  // refused: the Python path
    // not learned yet: the dispatcher records the key while it serves the call (a function it reaches again on the
    // way, for whatever reason, runs its Python path: no loop)
    {
      DirectDispatch dispatching;
      d->handle.callBoxed(stack);
    }
    return direct_results_or_none(stack, d->rets);
  } catch (pybind11::error_already_set& e) {
    if (!droppable(e)) return nullptr;
  } catch (...) {
    // a C++ error on the way (out of memory, a bad argument the op refused): the Python path runs the call again
    // and raises what it raises; a BaseException already set stays
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
  }
  PyErr_Clear();
  Py_RETURN_NONE;
}

PyMethodDef direct_def = {"rtckern_native_direct",
                          reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&direct_call)), METH_FASTCALL,
                          "direct(slot, *args): the bound op's results, or None (rtckern native front)"};
#endif  // RTK_DIRECT

}  // namespace

// ---- gradients: C++ autograd nodes -------------------------------------------------------------------------------
// A call needing a gradient of an op with a formula here runs as a torch::autograd::Function: its forward calls the
// op below autograd (the CUDA key: the replay above, or the op's Python implementation), its backward calls the
// backward op through the dispatcher (replayed as any call without a gradient). The Python autograd.Function costs
// ~100 us per forward + backward on an H200 host (the engine's hop into Python for the backward among it); this
// keeps the whole autograd round trip in C++. The formulas mirror the Python ones (named per struct); the GPU tests
// compare the gradients of both paths.
namespace rtckern_grad {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using opt_tensor = std::optional<at::Tensor>;

c10::IValue optional_ivalue(const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); }

// op(args...) through the dispatcher: its outputs
std::vector<at::Tensor> call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(stack);
  std::vector<at::Tensor> out;
  out.reserve(stack.size());
  for (auto& v : stack) out.push_back(std::move(v).toTensor());
  return out;
}

// A composite op's node (rtckern::rms_norm, layer_norm, fused_add_rms_norm, attention): its arguments are a prefix of
// its forward kernel op's (st->recompute), which returns the statistics as well.
bool composite(const OpState* st) {
  return st->self->schema().arguments().size() < st->recompute->schema().arguments().size();
}

// The forward of every formula, below autograd: the op on the stack's arguments, or for a composite its forward kernel
// op with None for the arguments the composite lacks and true for the last (return_rstd / return_stats / return_lse).
// Every output of the op called; node_outputs keeps the node's own.
variable_list run_forward(const OpState* st, torch::jit::Stack* stack) {
  const bool comp = composite(st);
  const c10::OperatorHandle& op = comp ? *st->recompute : *st->self;
  if (comp) {
    const size_t nf = op.schema().arguments().size();
    for (size_t i = st->self->schema().arguments().size(); i + 1 < nf; ++i) stack->emplace_back();
    stack->emplace_back(true);
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(stack);
  }
  const size_t nret = op.schema().returns().size();
  variable_list out;
  out.reserve(nret);
  for (size_t j = stack->size() - nret; j < stack->size(); ++j) out.push_back((*stack)[j].toTensor());
  torch::jit::drop(*stack, nret);
  return out;
}

// The outputs the node returns: all of them, or a composite's first ones (its statistics stay saved, not returned).
variable_list node_outputs(const OpState* st, variable_list out) {
  out.resize(st->self->schema().returns().size());
  return out;
}

const c10::IValue& arg(const torch::jit::Stack& stack, size_t nargs, size_t i) {
  return stack[stack.size() - nargs + i];
}

// A node's op state, kept in its context (the states live as long as the process).
void keep_state(AutogradContext* ctx, const OpState* st) { ctx->saved_data["st"] = reinterpret_cast<int64_t>(st); }
const OpState* state_of(AutogradContext* ctx) {
  return reinterpret_cast<const OpState*>(ctx->saved_data["st"].toInt());
}

// What every backward starts from: the node's op state and the tensors its forward saved.
struct Node {
  const OpState* st;
  variable_list saved;
};
Node node_of(AutogradContext* ctx) { return {state_of(ctx), ctx->get_saved_variables()}; }

// The two forward outputs a formula saved at saved[at] and saved[at + 1] (layer_norm's mean and rstd, attention's o and
// lse), or, where the forward ran without them (its forward kernel op called without return_stats / return_lse, whose
// placeholders are empty) while its first input is not, outputs `from` and `from + 1` of the recomputing op on args.
std::pair<at::Tensor, at::Tensor> saved_or_recomputed(const Node& node, size_t at, size_t from,
                                                      torch::jit::Stack args) {
  const variable_list& s = node.saved;
  if (s[at + 1].numel() != 0 || s[0].numel() == 0) return {s[at], s[at + 1]};
  auto out = call(*node.st->recompute, std::move(args));
  return {out[from], out[from + 1]};
}

// The end of every forward: the tensors the backward reads and the node's state saved, its outputs returned.
// materialize false: no zeros for the gradients of outputs the formula ignores (the statistics), as in Python.
variable_list finish(AutogradContext* ctx, const OpState* st, variable_list out, variable_list to_save,
                     bool materialize) {
  ctx->save_for_backward(std::move(to_save));
  keep_state(ctx, st);
  ctx->set_materialize_grads(materialize);
  return node_outputs(st, std::move(out));
}

// The norms' eps and zero_centered (arguments at and at + 1 of the node's op), kept for the backward.
void keep_norm_scalars(AutogradContext* ctx, const OpState* st, const torch::jit::Stack& stack, size_t at) {
  const size_t n = st->self->schema().arguments().size();
  ctx->saved_data["eps"] = arg(stack, n, at).toDouble();
  ctx->saved_data["zc"] = arg(stack, n, at + 1).toBool();
}

std::pair<double, bool> norm_scalars(AutogradContext* ctx) {
  return {ctx->saved_data["eps"].toDouble(), ctx->saved_data["zc"].toBool()};
}

// A backward's result: one gradient per forward argument (the op state, the stack, the three tensors), the first two
// never defined.
variable_list input_grads(at::Tensor a = {}, at::Tensor b = {}, at::Tensor c = {}) {
  return {at::Tensor(), at::Tensor(), std::move(a), std::move(b), std::move(c)};
}

// rtckern::rms_norm_fwd(x, weight?, eps, zero_centered, out_dtype?, return_rstd) -> (y, rstd);
// mirrors _rms_setup / _rms_backward (_torch_norms.py).
struct RmsNormBackward : torch::autograd::Function<RmsNormBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor& x,
                               const opt_tensor& w, const opt_tensor&) {
    keep_norm_scalars(ctx, st, *stack, 2);
    auto out = run_forward(st, stack);
    variable_list to_save{*x, w.value_or(at::Tensor()), out[1]};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return input_grads();
    const auto [st, saved] = node_of(ctx);
    const at::Tensor &x = saved[0], &w = saved[1];
    at::Tensor rstd = saved[2];
    const auto [eps, zc] = norm_scalars(ctx);
    if (rstd.numel() == 0 && x.numel() != 0)  // the forward ran without return_rstd: recompute it
      rstd = call(*st->recompute, {x, optional_ivalue(w), eps, zc, c10::IValue(), true})[1];
    const bool want_w = w.defined() && ctx->needs_input_grad(1);
    auto g = call(*st->backward, {grads[0].contiguous(), x, optional_ivalue(w), rstd, zc, want_w, c10::IValue()});
    return input_grads(g[0], want_w ? g[1] : at::Tensor());
  }
};

// rtckern::fused_add_rms_norm_fwd(x, residual, weight?, eps, zero_centered, out_dtype?, return_rstd) -> (y, h, rstd);
// mirrors _add_rms_setup / _add_rms_backward (_torch_norms.py).
struct AddRmsNormBackward : torch::autograd::Function<AddRmsNormBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor&,
                               const opt_tensor&, const opt_tensor& w) {
    keep_norm_scalars(ctx, st, *stack, 3);
    auto out = run_forward(st, stack);
    variable_list to_save{out[1], w.value_or(at::Tensor()), out[2]};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [st, saved] = node_of(ctx);
    const at::Tensor &h = saved[0], &w = saved[1];
    at::Tensor rstd = saved[2];
    const auto [eps, zc] = norm_scalars(ctx);
    const bool want_w = w.defined() && ctx->needs_input_grad(2);
    const at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(h);
    const at::Tensor dres = grads[1].defined() ? grads[1].to(h.scalar_type()).contiguous() : at::Tensor();
    if (rstd.numel() == 0 && h.numel() != 0) {
      // (a composite's node always has its statistics: its st->recompute is fused_add_rms_norm_fwd, not this schema)
      TORCH_CHECK(!composite(st), "rtckern: fused_add_rms_norm's node lost its rstd");
      rstd = call(*st->recompute, {h, optional_ivalue(w), eps, zc, c10::IValue(), true})[1];
    }
    auto g = call(*st->backward, {dy.contiguous(), h, optional_ivalue(w), rstd, zc, want_w, optional_ivalue(dres)});
    return input_grads(g[0], g[0], want_w ? g[1] : at::Tensor());
  }
};

// rtckern::layer_norm_fwd(x, weight?, bias?, eps, zero_centered, out_dtype?, return_stats) -> (y, mean, rstd);
// mirrors _ln_setup / _ln_backward (_torch_norms.py).
struct LayerNormBackward : torch::autograd::Function<LayerNormBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor& x,
                               const opt_tensor& w, const opt_tensor& b) {
    keep_norm_scalars(ctx, st, *stack, 3);
    auto out = run_forward(st, stack);
    variable_list to_save{*x, w.value_or(at::Tensor()), b.value_or(at::Tensor()), out[1], out[2]};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return input_grads();
    const Node node = node_of(ctx);
    const at::Tensor &x = node.saved[0], &w = node.saved[1], &b = node.saved[2];
    const auto [eps, zc] = norm_scalars(ctx);
    const auto [mean, rstd] =
        saved_or_recomputed(node, 3, 1, {x, optional_ivalue(w), optional_ivalue(b), eps, zc, c10::IValue(), true});
    // the node's inputs are the defined tensors among (x, weight, bias): the bias's edge follows the weight's
    const bool want_w = w.defined() && ctx->needs_input_grad(1);
    const bool want_b = b.defined() && ctx->needs_input_grad(w.defined() ? 2 : 1);
    auto g = call(*node.st->backward, {grads[0].contiguous(), x, optional_ivalue(w), optional_ivalue(b), mean, rstd,
                                       zc, want_w, want_b});
    return input_grads(g[0], want_w ? g[1] : at::Tensor(), want_b ? g[2] : at::Tensor());
  }
};

// rtckern::attention_fwd(q, k, v, causal, softmax_scale?, return_lse) -> (o, lse);
// mirrors _setup / _backward (_torch_attention.py).
struct AttentionBackward : torch::autograd::Function<AttentionBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor& q,
                               const opt_tensor& k, const opt_tensor& v) {
    const size_t n = st->self->schema().arguments().size();
    ctx->saved_data["causal"] = arg(*stack, n, 3).toBool();
    ctx->saved_data["scale"] = arg(*stack, n, 4);
    auto out = run_forward(st, stack);
    variable_list to_save{*q, *k, *v, out[0], out[1]};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return input_grads();
    const Node node = node_of(ctx);
    const at::Tensor &q = node.saved[0], &k = node.saved[1], &v = node.saved[2];
    const bool causal = ctx->saved_data["causal"].toBool();
    const c10::IValue scale = ctx->saved_data["scale"];
    const auto [o, lse] = saved_or_recomputed(node, 3, 0, {q, k, v, causal, scale, true});  // (o again with the lse)
    auto g = call(*node.st->backward, {grads[0].contiguous(), q, k, v, o, lse, causal, scale,
                                       at::globalContext().deterministicAlgorithms()});
    return input_grads(g[0], g[1], g[2]);
  }
};

// rtckern::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
// softmax_scale?, return_lse) -> (o, lse); mirrors _setup / _backward (_torch_attention_varlen.py). The prefix sums
// take no gradient; the node saves them with q, k, v, o and lse.
struct AttentionVarlenBackward : torch::autograd::Function<AttentionVarlenBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor& q,
                               const opt_tensor& k, const opt_tensor& v) {
    const size_t n = st->self->schema().arguments().size();
    variable_list prefix{arg(*stack, n, 3).toTensor(), arg(*stack, n, 4).toTensor()};
    ctx->saved_data["max_q"] = arg(*stack, n, 5);
    ctx->saved_data["max_k"] = arg(*stack, n, 6);
    ctx->saved_data["causal"] = arg(*stack, n, 7).toBool();
    ctx->saved_data["scale"] = arg(*stack, n, 8);
    auto out = run_forward(st, stack);
    variable_list to_save{*q, *k, *v, out[0], out[1], std::move(prefix[0]), std::move(prefix[1])};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return input_grads();  // only the lse was used: nothing reaches q, k, v
    const Node node = node_of(ctx);
    const variable_list& s = node.saved;
    const c10::IValue max_q = ctx->saved_data["max_q"], max_k = ctx->saved_data["max_k"];
    const c10::IValue scale = ctx->saved_data["scale"];
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto [o, lse] = saved_or_recomputed(node, 3, 0, {s[0], s[1], s[2], s[5], s[6], max_q, max_k, causal, scale,
                                                           true});
    auto g = call(*node.st->backward, {grads[0].contiguous(), s[0], s[1], s[2], o, lse, s[5], s[6], max_q, max_k,
                                       causal, scale, at::globalContext().deterministicAlgorithms()});
    return input_grads(g[0], g[1], g[2]);
  }
};

// rtckern::softmax(x, scale) -> y and the other softmax ops of that form (scaled_masked_softmax(x, mask, scale): the
// boolean mask takes no gradient); mirrors setup / backward in _torch_softmax.py.
struct SoftmaxBackward : torch::autograd::Function<SoftmaxBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor&,
                               const opt_tensor&, const opt_tensor&) {
    const size_t n = st->self->schema().arguments().size();
    ctx->saved_data["scale"] = arg(*stack, n, n - 1).toDouble();
    auto out = run_forward(st, stack);
    variable_list to_save{out[0]};
    return finish(ctx, st, std::move(out), std::move(to_save), true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [st, saved] = node_of(ctx);
    auto g = call(*st->backward, {saved[0], grads[0].contiguous(), ctx->saved_data["scale"].toDouble()});
    return input_grads(g[0]);
  }
};

// rtckern::swiglu(gate, up) -> y; mirrors _setup / _backward in _torch_glu.py.
struct SwigluBackward : torch::autograd::Function<SwigluBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack,
                               const opt_tensor& gate, const opt_tensor& up, const opt_tensor&) {
    return finish(ctx, st, run_forward(st, stack), {*gate, *up}, true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [st, saved] = node_of(ctx);
    auto g = call(*st->backward, {grads[0].contiguous(), saved[0], saved[1]});
    return input_grads(g[0], g[1]);
  }
};

// rtckern::rope(q, k, cos, sin, unsqueeze_dim) -> (q_embed, k_embed), for tables that need no gradient (grad_call
// leaves the others to the Python formula, whose table gradients are torch ops); mirrors _setup / _backward in
// _torch_rope.py.
struct RopeBackward : torch::autograd::Function<RopeBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack, const opt_tensor&,
                               const opt_tensor&, const opt_tensor&) {
    const size_t n = 5;
    variable_list tables{arg(*stack, n, 2).toTensor(), arg(*stack, n, 3).toTensor()};
    ctx->saved_data["dim"] = arg(*stack, n, 4).toInt();
    return finish(ctx, st, run_forward(st, stack), std::move(tables), true);
  }
  static at::Tensor dense_rows(const at::Tensor& g) {  // head_dim contiguous, as the kernel reads it
    return g.stride(-1) == 1 || g.size(-1) == 1 ? g : g.contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [st, saved] = node_of(ctx);
    auto g = call(*st->backward, {dense_rows(grads[0]), dense_rows(grads[1]), saved[0], saved[1],
                                  ctx->saved_data["dim"].toInt()});
    return input_grads(g[0], g[1]);
  }
};

// rtckern::cross_entropy_fwd(logits, labels, ignore_index, reduction) -> (loss, lse, count); mirrors _setup /
// _backward in _torch_loss.py (a gradient reaching the lse itself, a z-loss, adds softmax * dlse by ATen ops there
// and here).
struct CrossEntropyBackward : torch::autograd::Function<CrossEntropyBackward> {
  static variable_list forward(AutogradContext* ctx, const OpState* st, torch::jit::Stack* stack,
                               const opt_tensor& logits, const opt_tensor&, const opt_tensor&) {
    const size_t n = 4;
    const at::Tensor labels = arg(*stack, n, 1).toTensor();
    const bool mean = arg(*stack, n, 3).toStringRef() == "mean";
    ctx->saved_data["ignore"] = arg(*stack, n, 2).toInt();
    auto out = run_forward(st, stack);
    variable_list to_save{*logits, labels, out[1], mean ? out[2] : at::Tensor()};
    return finish(ctx, st, std::move(out), std::move(to_save), false);
  }
  static at::Tensor one_stride(at::Tensor t, c10::ScalarType dtype) {  // _one_stride
    if (t.scalar_type() != dtype) t = t.to(dtype);
    if (t.is_contiguous()) return t;
    for (int64_t s : t.strides())
      if (s != 0) return t.contiguous();
    return t;  // a broadcast value: stride 0 everywhere
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [st, saved] = node_of(ctx);
    const at::Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2], &count = saved[3];
    at::Tensor dx;
    if (grads[0].defined())
      dx = call(*st->backward, {one_stride(grads[0], lse.scalar_type()), logits, labels, lse, optional_ivalue(count),
                                ctx->saved_data["ignore"].toInt()})[0];
    if (grads[1].defined()) {
      const auto f = lse.scalar_type();
      at::Tensor extra = logits.to(f).sub(lse.unsqueeze(-1)).exp().mul(grads[1].to(f).unsqueeze(-1));
      dx = (dx.defined() ? dx.to(f).add(extra) : extra).to(logits.scalar_type());
    }
    return input_grads(dx);
  }
};

// The tensor arguments a formula's node takes as inputs: their positions in the op's arguments.
constexpr std::array<std::array<int, 3>, 10> kTensorArgs = {{{-1, -1, -1}, {0, 1, -1}, {0, 1, 2}, {0, 1, 2},
                                                             {0, 1, 2}, {0, -1, -1}, {0, 1, -1}, {0, 1, -1},
                                                             {0, -1, -1}, {0, 1, 2}}};

}  // namespace rtckern_grad

namespace {

// A call needing a gradient, of an op with a formula, with plain dense tensors on the replay device and nothing
// tracing or intercepting it: run as the formula's C++ autograd node. False when it is not served here.
bool grad_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (bypass || grad_bypass || !c10::GradMode::is_enabled() ||
      c10::impl::tls_local_dispatch_key_set().included_.has_any(kNotPlain))
    return false;
  OpState* state = nullptr;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    auto it = ops.find(op.schema().name());
    if (it != ops.end()) state = it->second.get();
  }
  const uint8_t f = state != nullptr ? state->formula.load(std::memory_order_acquire) : kNoFormula;
  if (f == kNoFormula) return false;
  const size_t n = op.schema().arguments().size();
  const size_t first = stack->size() - n;
  bool any_grad = false;
  for (size_t i = first; i < first + n; ++i) {
    const c10::IValue& v = (*stack)[i];
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    if (t.device().type() != replay_device || t.layout() != c10::kStrided || t.key_set().has_any(kNotPlain))
      return false;
    any_grad = any_grad || t.requires_grad();
  }
  if (!any_grad) return false;
  if (f == kRope && ((*stack)[first + 2].toTensor().requires_grad() || (*stack)[first + 3].toTensor().requires_grad()))
    return false;  // table gradients: the Python formula (torch ops)
  std::array<std::optional<at::Tensor>, 3> a;
  for (int j = 0; j < 3; ++j) {
    const int i = rtckern_grad::kTensorArgs[f][j];
    if (i >= 0 && (*stack)[first + i].isTensor()) a[j] = (*stack)[first + i].toTensor();
  }
  torch::autograd::variable_list out;
  switch (f) {
    case kRmsNorm: out = rtckern_grad::RmsNormBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kAddRmsNorm: out = rtckern_grad::AddRmsNormBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kLayerNorm: out = rtckern_grad::LayerNormBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kAttention: out = rtckern_grad::AttentionBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kSoftmax: out = rtckern_grad::SoftmaxBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kSwiglu: out = rtckern_grad::SwigluBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kRope: out = rtckern_grad::RopeBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kCrossEntropy: out = rtckern_grad::CrossEntropyBackward::apply(state, stack, a[0], a[1], a[2]); break;
    case kAttentionVarlen: out = rtckern_grad::AttentionVarlenBackward::apply(state, stack, a[0], a[1], a[2]); break;
    default: return false;
  }
  for (auto& t : out) stack->emplace_back(std::move(t));  // (the forward took the arguments off the stack)
  return true;
}

// At AutogradCUDA: what is not served goes to the Python kernels, the op's autograd (or composite) kernel, which is
// registered at AutogradOther too.
void native_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  OpState* state;
  if (serve(op, stack, state)) return;
  if (grad_call(op, stack)) return;
  op.redispatchBoxed((ks & c10::after_autograd_keyset) | c10::DispatchKeySet(c10::DispatchKey::AutogradOther), stack);
}

// At CUDA, which calls under torch.inference_mode() reach without the autograd keys (and calls redispatched below
// autograd): what is not served goes to the op's Python implementation, registered as the python twin.
void native_backend_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  OpState* state;
  if (serve(op, stack, state)) return;
  if (state == nullptr) {
    std::shared_lock<std::shared_mutex> lock(table_mutex);
    auto it = ops.find(op.schema().name());
    TORCH_CHECK(it != ops.end(), "rtckern: ", op.schema().name(), " is not served by the native front");
    state = it->second.get();
  }
  state->python.callBoxed(stack);
}

template <typename T>
bool read(const char*& p, const char* end, T& out) {
  if (end - p < static_cast<std::ptrdiff_t>(sizeof(T))) return false;
  std::memcpy(&out, p, sizeof(T));
  p += sizeof(T);
  return true;
}

}  // namespace

namespace {

// What each formula reads of and passes to its ops (the positions the structs above use): the argument kinds ('T' a
// tensor, 't' an optional tensor, 'f' a float, 'F' an optional float, 'b' a bool, 'i' an int, 's' a string, 'o' an
// optional of any type, '.' anything) and number of results of the op, its backward op and its recomputing op. A
// formula registered for ops of other schemas would read or pass the wrong stack slots: rtk_register_grad refuses it.
struct Shape {
  const char* args;      // the op's argument kinds
  size_t rets;           // its results
  const char* bwd_args;  // the backward op's
  size_t bwd_rets;
  const char* rec_args;  // the recomputing op's
  size_t rec_rets;
};

bool kind_fits(char want, const c10::Argument& a) {
  const auto k = a.type()->kind();
  const bool optional = k == c10::TypeKind::OptionalType;
  const auto inner = optional ? a.type()->containedType(0)->kind() : k;
  switch (want) {
    case 'T': return k == c10::TypeKind::TensorType;
    case 't': return inner == c10::TypeKind::TensorType;
    case 'f': return k == c10::TypeKind::FloatType;
    case 'F': return inner == c10::TypeKind::FloatType;
    case 'b': return k == c10::TypeKind::BoolType;
    case 'i': return k == c10::TypeKind::IntType || k == c10::TypeKind::SymIntType;
    case 's': return k == c10::TypeKind::StringType;
    case 'o': return optional;  // optional of any type: a slot a composite's forward gets None for
    default: return true;
  }
}

bool schema_fits(const c10::FunctionSchema& schema, const char* kinds, size_t rets) {
  const auto& args = schema.arguments();
  if (args.size() != std::strlen(kinds) || schema.returns().size() != rets) return false;
  for (size_t i = 0; i < args.size(); ++i)
    if (!kind_fits(kinds[i], args[i])) return false;
  return true;
}

bool schemas_fit(uint8_t formula, const c10::FunctionSchema& self, const c10::FunctionSchema& bwd,
                 const c10::FunctionSchema& rec) {
  static const std::unordered_map<uint8_t, std::vector<Shape>> shapes = {
      // (second shapes: the composites, whose "recomputing" op is their forward kernel op)
      {kRmsNorm, {{"Ttfb.b", 2, "TTtTbbt", 2, "Ttfb.b", 2}, {"Ttfb.", 1, "TTtTbbt", 2, "Ttfb.b", 2}}},
      {kAddRmsNorm, {{"TTtfb.b", 3, "TTtTbbt", 2, "Ttfb.b", 2}, {"TTtfb", 2, "TTtTbbt", 2, "TTtfbob", 3}}},
      {kLayerNorm, {{"Tttfb.b", 3, "TTttTTbbb", 3, "Tttfb.b", 3}, {"Tttfb.", 1, "TTttTTbbb", 3, "Tttfb.b", 3}}},
      {kAttention, {{"TTTbFb", 2, "TTTTTTbFb", 3, "TTTbFb", 2}, {"TTTbF", 1, "TTTTTTbFb", 3, "TTTbFb", 2}}},
      {kSoftmax, {{"Tf", 1, "TTf", 1, "Tf", 1}, {"TTf", 1, "TTf", 1, "TTf", 1}}},
      {kSwiglu, {{"TT", 1, "TTT", 2, "TT", 1}}},
      {kRope, {{"TTTTi", 2, "TTTTi", 2, "TTTTi", 2}}},
      {kCrossEntropy, {{"TTis", 3, "TTTTti", 1, "TTis", 3}}},
      {kAttentionVarlen,
       {{"TTTTTiibFb", 2, "TTTTTTTTiibFb", 3, "TTTTTiibFb", 2},
        {"TTTTTiibF", 1, "TTTTTTTTiibFb", 3, "TTTTTiibFb", 2}}}};
  auto it = shapes.find(formula);
  if (it == shapes.end()) return false;
  for (const Shape& sh : it->second)
    if (schema_fits(self, sh.args, sh.rets) && schema_fits(bwd, sh.bwd_args, sh.bwd_rets) &&
        schema_fits(rec, sh.rec_args, sh.rec_rets))
      return true;
  return false;
}

}  // namespace

#define RTK_EXPORT __attribute__((visibility("default")))  // the build hides every other symbol

extern "C" {

// init(libcuda path): the driver entry points. 0 on success.
RTK_EXPORT int rtk_init(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen(path, RTLD_NOW);
  if (h == nullptr) return -1;
  cu_launch = reinterpret_cast<launch_fn>(dlsym(h, "cuLaunchKernel"));
  cu_launch_ex = reinterpret_cast<launch_ex_fn>(dlsym(h, "cuLaunchKernelEx"));
  cu_ctx_get = reinterpret_cast<ctx_get_fn>(dlsym(h, "cuCtxGetCurrent"));
  cu_ctx_push = reinterpret_cast<ctx_push_fn>(dlsym(h, "cuCtxPushCurrent_v2"));
  cu_ctx_pop = reinterpret_cast<ctx_pop_fn>(dlsym(h, "cuCtxPopCurrent_v2"));
  cu_tensor_map_replace_address = reinterpret_cast<replace_address_fn>(dlsym(h, "cuTensorMapReplaceAddress"));
  if (!cu_launch || !cu_ctx_get || !cu_ctx_push || !cu_ctx_pop) {
    cu_launch = nullptr;
    return -2;
  }
  return 0;
}

// Test hook: replay on CPU tensors and hand each launch to fn instead of the driver.
RTK_EXPORT void rtk_test_device(test_launch_fn fn) {
  test_launch = fn;
  replay_device = fn != nullptr ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
}

// Serve op_name (e.g. "rtckern::rms_norm") at autograd_key ("AutogradCUDA") and backend_key ("CUDA"; AutogradCPU
// and CPU in the CPU tests), recording misses through recorder_name; python_name is the op's Python implementation,
// for what the backend kernel does not replay. 0 on success, -1 when an op is not defined.
RTK_EXPORT int rtk_register(const char* op_name, const char* recorder_name, const char* python_name,
                            const char* autograd_key, const char* backend_key) {
  auto& d = c10::Dispatcher::singleton();
  auto op = d.findOp(c10::OperatorName(op_name, ""));
  auto rec = d.findOp(c10::OperatorName(recorder_name, ""));
  auto py = d.findOp(c10::OperatorName(python_name, ""));
  if (!op || !rec || !py) return -1;
  {
    std::unique_lock<std::shared_mutex> lock(table_mutex);
    if (ops.count(op_name)) return 0;  // served already (a kernel reads its state without the lock's protection)
    ops[op_name] = std::make_unique<OpState>(*rec, *py);
  }
  static std::vector<std::unique_ptr<torch::Library>> libraries;  // registrations live as long as the process
  const std::string qualified(op_name);
  const auto sep = qualified.find("::");
  const auto name = qualified.substr(sep + 2);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, qualified.substr(0, sep),
                                              c10::parseDispatchKey(autograd_key), __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&native_kernel>());
  libraries.push_back(std::move(lib));
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, qualified.substr(0, sep),
                                         c10::parseDispatchKey(backend_key), __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&native_backend_kernel>());
  libraries.push_back(std::move(lib));
  return 0;
}

// During a recording (inside the recorder twin): the call's launches, serialized by _torch_native.py:
//   u32 ntemps, u64 bytes of each workspace; u32 nsteps, then per step u8 'Z' (zero) with u8 source (output or
//   workspace), i16 index, or u8 'L' (launch) with u64 func, u64 ctx, u32 grid[3], u32 block[3], u32 smem,
//   i32 dependent, u32 label length, label bytes, u32 nparams, then per parameter: u8 kind, u8 source, i16 index,
//   and u64 bits (a constant, or an offset into an output or workspace), or for a tensor map ('M', source the
//   buffer whose address it holds) its 128 bytes.
// An empty offer (len 0) leaves the key unlearned. 0 when taken; -1 when no recording is pending in this thread;
// -2 when the description is malformed.
RTK_EXPORT int rtk_offer(const char* data, size_t len) {
  if (!pending.active) return -1;
  if (len == 0) {
    pending.skipped = true;
    return 0;
  }
  const char* p = data;
  const char* end = data + len;
  uint32_t nt = 0, ns = 0;
  if (!read(p, end, nt) || nt > 64) return -2;
  std::vector<int64_t> temps(nt);
  for (auto& b : temps)
    if (!read(p, end, b) || b < 0) return -2;
  if (!read(p, end, ns) || ns == 0 || ns > 64) return -2;
  std::vector<Step> steps(ns);
  for (Step& s : steps) {
    if (!read(p, end, s.kind)) return -2;
    if (s.kind == 'Z') {
      if (!read(p, end, s.source) || !read(p, end, s.index) || (s.source != kOutput && s.source != kTemp) ||
          s.index < 0)
        return -2;
      continue;
    }
    if (s.kind != 'L') return -2;
    Launch& l = s.launch;
    uint64_t func, ctx;
    uint32_t label_len, np;
    if (!read(p, end, func) || !read(p, end, ctx)) return -2;
    l.func = reinterpret_cast<void*>(func);
    l.ctx = reinterpret_cast<void*>(ctx);
    for (auto& g : l.grid) if (!read(p, end, g)) return -2;
    for (auto& b : l.block) if (!read(p, end, b)) return -2;
    if (!read(p, end, l.smem) || !read(p, end, l.dependent) || !read(p, end, label_len)) return -2;
    if (end - p < static_cast<std::ptrdiff_t>(label_len)) return -2;
    l.label.assign(p, label_len);
    p += label_len;
    if (!read(p, end, np) || np > kMaxParams) return -2;
    int off = 0;
    for (uint32_t i = 0; i < np; ++i) {
      Param q{};
      if (!read(p, end, q.kind) || !read(p, end, q.source) || !read(p, end, q.index)) return -2;
      if (q.kind == 'M') {
        if (q.source == kConst || cu_tensor_map_replace_address == nullptr || end - p < 128) return -2;
        auto map = std::make_shared<std::array<unsigned char, 128>>();
        std::memcpy(map->data(), p, 128);
        p += 128;
        q.map = std::move(map);
      } else if (!read(p, end, q.bits)) {
        return -2;
      }
      const int sz = kind_size(q.kind), al = kind_align(q.kind);
      if (sz == 0 || q.source > kTemp || q.index < 0 || (q.source == kInput && q.bits != 0)) return -2;
      off = (off + al - 1) / al * al;
      q.offset = off;
      off += sz;
      if (off > kBlockBytes) return -2;
      l.params.push_back(q);
    }
  }
  if (p != end) return -2;
  pending.temps = std::move(temps);
  pending.steps = std::move(steps);
  pending.offered = true;
  return 0;
}

// Serve calls of op_name that need a gradient as a C++ autograd node with the formula named ("rms_norm",
// "fused_add_rms_norm", "layer_norm", "attention", "attention_varlen": those of rtckern::<formula>_fwd and of the
// composite rtckern::<formula>; "softmax": rtckern::softmax's and its masked and causal forms'; "swiglu", "rope",
// "cross_entropy"), for ops of that schema,
// whose backward op is backward_name and whose statistics a recomputation takes from recompute_name. 0 on success, -1
// for an op not served or not defined, -2 for a formula not known here, -3 for ops whose schemas the formula does not
// fit.
RTK_EXPORT int rtk_register_grad(const char* op_name, const char* formula, const char* backward_name,
                                 const char* recompute_name) {
  static const std::unordered_map<std::string, uint8_t> formulas = {
      {"rms_norm", kRmsNorm}, {"fused_add_rms_norm", kAddRmsNorm}, {"layer_norm", kLayerNorm},
      {"attention", kAttention}, {"softmax", kSoftmax}, {"swiglu", kSwiglu}, {"rope", kRope},
      {"cross_entropy", kCrossEntropy}, {"attention_varlen", kAttentionVarlen}};
  auto f = formulas.find(formula);
  if (f == formulas.end()) return -2;
  auto& d = c10::Dispatcher::singleton();
  auto self = d.findOp(c10::OperatorName(op_name, ""));
  auto bwd = d.findOp(c10::OperatorName(backward_name, ""));
  auto rec = d.findOp(c10::OperatorName(recompute_name, ""));
  if (!self || !bwd || !rec) return -1;
  if (!schemas_fit(f->second, self->schema(), bwd->schema(), rec->schema())) return -3;
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  auto it = ops.find(op_name);
  if (it == ops.end()) return -1;
  OpState& st = *it->second;
  if (st.formula.load() != kNoFormula) return 0;  // registered already: the handles a node may be reading stay
  st.self = *self;
  st.backward = *bwd;
  st.recompute = *rec;
  st.formula.store(f->second, std::memory_order_release);
  return 0;
}

#ifdef RTK_DIRECT
// Bind slot (0..63) to op_name (served already: rtk_register) for direct_call. 0 on success (or when slot is bound
// to op_name already), -1 for an op not served, -2 for a slot out of range, -3 for an op whose arguments are not
// tensors, floats, bools, ints, strings and optionals or whose results are not all tensors, -4 for a slot bound to
// another op.
RTK_EXPORT int rtk_direct_bind(int slot, const char* op_name) {
  if (slot < 0 || slot >= kDirectSlots) return -2;
  auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(op_name, ""));
  if (!handle) return -1;
  const auto& schema = handle->schema();
  std::string kinds;
  for (const auto& a : schema.arguments()) {
    char k = 0;
    for (char want : {'T', 't', 'f', 'b', 'i', 's'})
      if (kind_fits(want, a)) {
        k = want;
        break;
      }
    if (k == 0 && kind_fits('o', a)) k = 'n';
    if (k == 0) return -3;  // (a SymInt argument is 'i': a Python int, an int IValue, as the dispatcher makes it)
    kinds.push_back(k);
  }
  for (const auto& r : schema.returns())
    if (r.type()->kind() != c10::TypeKind::TensorType) return -3;
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  auto it = ops.find(op_name);
  if (it == ops.end()) return -1;
  if (const DirectOp* bound = direct_ops[slot].load()) return bound->state == it->second.get() ? 0 : -4;
  direct_ops[slot].store(new DirectOp{it->second.get(), *handle, std::move(kinds), schema.returns().size()},
                         std::memory_order_release);
  return 0;
}

// The direct entry as a Python function (a new reference; called through ctypes with the GIL held).
RTK_EXPORT PyObject* rtk_direct_function() { return PyCFunction_New(&direct_def, nullptr); }

// 1 while this thread's direct_call is calling its op through the dispatcher (the plugin's fallback to torch is off).
RTK_EXPORT int rtk_direct_dispatching() { return direct_dispatching ? 1 : 0; }
#endif  // RTK_DIRECT

// Forget every recipe (the settings changed, rtckern.clear_caches()); the caller then releases what kept their
// functions loaded.
RTK_EXPORT void rtk_clear() {
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  for (auto& kv : ops) kv.second->recipes.clear();
  recipe_count = 0;
  ++generation;
}

// This thread's calls take the Python kernels while on (rtckern.torch.reference_mode). Returns the old value.
RTK_EXPORT int rtk_bypass(int on) {
  const int old = bypass;
  bypass = on != 0;
  return old;
}

// This thread's calls needing a gradient take the Python autograd.Function (rtckern.testing.python_autograd, which
// compares the two). Returns the old value.
RTK_EXPORT int rtk_grad_bypass(int on) {
  const int old = grad_bypass;
  grad_bypass = on != 0;
  return old;
}

// Recipes and refused keys held, over all ops.
RTK_EXPORT size_t rtk_size() {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  return recipe_count;
}

// Of one op: the number of recipes (refused = 0) or of refused keys (refused = 1); -1 for an op not registered.
RTK_EXPORT long rtk_count(const char* op_name, int refused) {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  auto it = ops.find(op_name);
  if (it == ops.end()) return -1;
  long c = 0;
  for (const auto& kv : it->second->recipes) c += kv.second->refused == (refused != 0);
  return c;
}

}  // extern "C"
