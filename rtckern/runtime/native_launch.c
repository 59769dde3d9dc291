/* The native launch path: a prepared launch of one kernel at one geometry, called from Python as
 *     prepared(stream_handle, *args)
 * which converts each argument by its declared kind into a parameter block on the stack and calls the driver's
 * cuLaunchKernel once. Through cuda.core or cuda.bindings the same launch costs ~4 us of host time on an H100
 * (argument objects and conversion layers); a vectorcall into this file costs the driver call plus tens of ns.
 *
 * Built at first use by rtckern/runtime/native.py with the system C compiler (as Triton builds its launchers);
 * where no compiler or Python headers exist, rtckern launches through cuda.core instead. Nothing here links
 * against libcuda: the driver entry points are found in the process (cuda.bindings has loaded libcuda already).
 *
 * Kinds, one character per kernel parameter: 'P' pointer / u64, 'q' int64, 'i' int32, 'I' uint32, 'f' float32,
 * 'd' float64, 'M' a 128-byte by-value struct (a CUtensorMap: a bytes-like object of 128 bytes, 64-aligned).
 *
 * Prepared(func, ctx, grid, block, smem, kinds, label[, dependent[, owner]]), positional: owner is kept alive with
 * the prepared launch (the kernel's Library, which unloads the module when collected).
 *
 * A dependent launch (dependent true) goes through cuLaunchKernelEx with programmatic stream
 * serialization: the kernel may start while the stream's previous kernel finishes and waits for it on the device
 * (griddepcontrol.wait, common/pdl.cuh). A driver without cuLaunchKernelEx launches it plainly: the wait is then a
 * no-op and stream order does the same job a little later.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
typedef int (*launch_ex_fn)(const void*, void*, void**, void**);
typedef int (*ctx_get_fn)(void**);
typedef int (*ctx_push_fn)(void*);
typedef int (*ctx_pop_fn)(void**);
typedef int (*error_name_fn)(int, const char**);

static launch_fn cu_launch = NULL;
static launch_ex_fn cu_launch_ex = NULL; /* optional: dependent launches fall back to cu_launch without it */
static ctx_get_fn cu_ctx_get = NULL;
static ctx_push_fn cu_ctx_push = NULL;
static ctx_pop_fn cu_ctx_pop = NULL;
static error_name_fn cu_error_name = NULL; /* optional: names the CUresult of a failed launch */
static PyObject* launch_error = NULL; /* rtckern.errors.LaunchError, set by init() */
/* record(list) / record(None): while a list is set, every prepared launch made by the thread that set it appends
   (prepared, args) to it before launching (rtckern/plugins/_torch_native.py learns a call's launches this way);
   other threads' launches are not recorded. Read and written under the GIL. */
static PyObject* recorder = NULL;
static unsigned long recorder_thread = 0;

#define MAX_PARAMS 48
#define BLOCK_BYTES 2048
#define RTK_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */

/* cuda.h's CUlaunchAttribute and CUlaunchConfig, laid out alike (this file does not include cuda.h) */
typedef struct {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int allowed; /* programmaticStreamSerializationAllowed */
    void* align;
  } value;
} rtk_launch_attribute;

typedef struct {
  unsigned grid[3], block[3], smem;
  void* stream;
  rtk_launch_attribute* attrs;
  unsigned nattrs;
} rtk_launch_config;
_Static_assert(sizeof(rtk_launch_attribute) == 72 && offsetof(rtk_launch_attribute, value) == 8, "CUlaunchAttribute");
_Static_assert(offsetof(rtk_launch_config, stream) == 32 && sizeof(rtk_launch_config) == 56, "CUlaunchConfig");

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  void* func;
  void* ctx; /* the device's primary context: pushed when another one is current */
  unsigned grid[3], block[3], smem;
  int dependent; /* launch with programmatic stream serialization (cuLaunchKernelEx) */
  int nparams;
  char kinds[MAX_PARAMS];
  int offsets[MAX_PARAMS];
  PyObject* label;
  PyObject* owner; /* what keeps `func` loaded (the kernel's Library): released with the prepared launch */
} Prepared;

static int kind_size(char k) {
  switch (k) {
    case 'P': case 'q': case 'd': return 8;
    case 'i': case 'I': case 'f': return 4;
    case 'M': return 128;
    default: return 0;
  }
}

static int kind_align(char k) { return k == 'M' ? 64 : kind_size(k); }

static PyObject* fail(Prepared* self, const char* call, int err) {
  const char* name = NULL;
  if (cu_error_name == NULL || cu_error_name(err, &name) != 0 || name == NULL) name = "unknown CUresult";
  PyErr_Format(launch_error ? launch_error : PyExc_RuntimeError,
               "launch of %U failed: %s returned %s (%d) (grid (%u, %u, %u), block (%u, %u, %u), shared memory %u)",
               self->label, call, name, err, self->grid[0], self->grid[1], self->grid[2], self->block[0],
               self->block[1], self->block[2], self->smem);
  return NULL;
}

/* PyLong_AsUnsigned* take Python ints only; numpy's unsigned scalars (np.uint64 pointers, np.uint32) come through
   their __index__. */
static unsigned long long rtk_as_u64(PyObject* a) {
  if (PyLong_Check(a)) return PyLong_AsUnsignedLongLong(a);
  PyObject* i = PyNumber_Index(a);
  if (i == NULL) return (unsigned long long)-1;
  unsigned long long v = PyLong_AsUnsignedLongLong(i);
  Py_DECREF(i);
  return v;
}

/* 'f': a double that float cannot hold (|v| > FLT_MAX: the conversion is undefined in C) is refused; inf / nan pass. */
static double rtk_as_f32(PyObject* a) {
  double v = PyFloat_AsDouble(a);
  if (v == -1.0 && PyErr_Occurred()) return -1.0;
  if (isfinite(v) && fabs(v) > FLT_MAX) {
    PyErr_Format(PyExc_OverflowError, "%R is outside float32", a);
    return -1.0;
  }
  return v;
}

/* 'i' and 'I': the 64-bit reads above, then refused (OverflowError) outside int32 / uint32: never truncated. */
static long long rtk_as_i32(PyObject* a) {
  long long v = PyLong_AsLongLong(a);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "%lld is outside int32", v);
    return -1;
  }
  return v;
}

static unsigned long long rtk_as_u32(PyObject* a) {
  unsigned long long v = rtk_as_u64(a);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return (unsigned long long)-1;
  if (v > UINT32_MAX) {
    PyErr_Format(PyExc_OverflowError, "%llu is outside uint32", v);
    return (unsigned long long)-1;
  }
  return v;
}

/* One number argument of a prepared_call switch case: CONV(a) as CT (CT's -1 with an exception set is an error),
   narrowed to ST and stored at dst. */
#define RTK_PACK_NUMBER(CONV, CT, ST)                  \
  {                                                    \
    CT v = CONV(a);                                    \
    if (v == (CT)-1 && PyErr_Occurred()) goto bad;     \
    ST w = (ST)v;                                      \
    memcpy(dst, &w, sizeof(ST));                       \
    break;                                             \
  }

static PyObject* prepared_call(PyObject* obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Prepared* self = (Prepared*)obj;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
    PyErr_SetString(PyExc_TypeError, "a prepared launch takes positional arguments only");
    return NULL;
  }
  if (nargs != self->nparams + 1) {
    PyErr_Format(PyExc_TypeError, "launch of %U takes a stream and %d kernel arguments; got %zd arguments",
                 self->label, self->nparams, nargs);
    return NULL;
  }
  if (recorder != NULL && PyThread_get_thread_ident() == recorder_thread) {
    PyObject* rest = PyTuple_New(nargs);
    if (rest == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(rest, i, args[i]);
    }
    PyObject* entry = PyTuple_Pack(2, obj, rest);
    Py_DECREF(rest);
    if (entry == NULL || PyList_Append(recorder, entry) != 0) {
      Py_XDECREF(entry);
      return NULL;
    }
    Py_DECREF(entry);
  }
  _Alignas(64) unsigned char block[BLOCK_BYTES];
  void* params[MAX_PARAMS];
  void* stream = PyLong_AsVoidPtr(args[0]);
  if (stream == NULL && PyErr_Occurred()) return NULL;
  for (int i = 0; i < self->nparams; ++i) {
    PyObject* a = args[i + 1];
    unsigned char* dst = block + self->offsets[i];
    params[i] = dst;
    switch (self->kinds[i]) {
      case 'P': RTK_PACK_NUMBER(rtk_as_u64, unsigned long long, unsigned long long)
      case 'q': RTK_PACK_NUMBER(PyLong_AsLongLong, long long, long long)
      case 'i': RTK_PACK_NUMBER(rtk_as_i32, long long, int32_t)
      case 'I': RTK_PACK_NUMBER(rtk_as_u32, unsigned long long, uint32_t)
      case 'f': RTK_PACK_NUMBER(rtk_as_f32, double, float)
      case 'd': RTK_PACK_NUMBER(PyFloat_AsDouble, double, double)
      case 'M': {
        Py_buffer view;
        if (PyObject_GetBuffer(a, &view, PyBUF_SIMPLE) != 0) goto bad;
        if (view.len != 128) {
          PyBuffer_Release(&view);
          PyErr_Format(PyExc_ValueError, "argument %d of %U: a tensor map is 128 bytes; got %zd", i, self->label,
                       view.len);
          return NULL;
        }
        memcpy(dst, view.buf, 128);
        PyBuffer_Release(&view);
        break;
      }
    }
    continue;
  bad : {
    /* the conversion's own reason (OverflowError: out of range; TypeError: not a number) stays the cause */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyErr_Format(type != NULL && PyErr_GivenExceptionMatches(type, PyExc_OverflowError) ? PyExc_OverflowError
                                                                                       : PyExc_TypeError,
                 "argument %d of %U (kind '%c'): cannot convert %R (%S)", i, self->label, self->kinds[i], a,
                 value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return NULL;
  }
  }
  int err, pushed = 0;
  const char* call = "cuCtxGetCurrent";
  Py_BEGIN_ALLOW_THREADS
  void* cur = NULL;
  err = cu_ctx_get(&cur);
  if (err == 0 && cur != self->ctx) {
    call = "cuCtxPushCurrent";
    err = cu_ctx_push(self->ctx);
    pushed = err == 0;
  }
  if (err == 0 && self->dependent && cu_launch_ex != NULL) {
    rtk_launch_attribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = RTK_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.allowed = 1;
    rtk_launch_config cfg = {{self->grid[0], self->grid[1], self->grid[2]},
                             {self->block[0], self->block[1], self->block[2]}, self->smem, stream, &attr, 1};
    call = "cuLaunchKernelEx";
    err = cu_launch_ex(&cfg, self->func, params, NULL);
  } else if (err == 0) {
    call = "cuLaunchKernel";
    err = cu_launch(self->func, self->grid[0], self->grid[1], self->grid[2], self->block[0], self->block[1],
                    self->block[2], self->smem, stream, params, NULL);
  }
  if (pushed) {
    void* popped;
    cu_ctx_pop(&popped);
  }
  Py_END_ALLOW_THREADS
  if (err != 0) return fail(self, call, err);
  Py_RETURN_NONE;
}

static PyObject* prepared_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  unsigned long long func, ctx;
  unsigned g[3], b[3], smem;
  const char* kinds;
  PyObject* label;
  PyObject* owner = Py_None;
  int dependent = 0;
  if (cu_launch == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "native_launch.init() was not called");
    return NULL;
  }
  if (kw != NULL && PyDict_GET_SIZE(kw) > 0) {
    PyErr_SetString(PyExc_TypeError, "Prepared(func, ctx, grid, block, smem, kinds, label[, dependent[, owner]]) "
                                     "takes positional arguments only");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "KK(III)(III)IsU|pO", &func, &ctx, &g[0], &g[1], &g[2], &b[0], &b[1], &b[2], &smem,
                        &kinds, &label, &dependent, &owner))
    return NULL;
  Py_ssize_t n = (Py_ssize_t)strlen(kinds);
  if (n > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "%zd kernel parameters; a prepared launch takes at most %d", n, MAX_PARAMS);
    return NULL;
  }
  Prepared* self = (Prepared*)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->vectorcall = prepared_call;
  self->func = (void*)(uintptr_t)func;
  self->ctx = (void*)(uintptr_t)ctx;
  memcpy(self->grid, g, sizeof g);
  memcpy(self->block, b, sizeof b);
  self->smem = smem;
  self->dependent = dependent;
  self->nparams = (int)n;
  int off = 0;
  for (int i = 0; i < n; ++i) {
    int sz = kind_size(kinds[i]), al = kind_align(kinds[i]);
    if (sz == 0) {
      Py_DECREF(self);
      PyErr_Format(PyExc_ValueError, "parameter kind '%c'; supported: P q i I f d M", kinds[i]);
      return NULL;
    }
    off = (off + al - 1) / al * al;
    self->kinds[i] = kinds[i];
    self->offsets[i] = off;
    off += sz;
  }
  if (off > BLOCK_BYTES) {
    Py_DECREF(self);
    PyErr_Format(PyExc_ValueError, "parameters take %d bytes; a prepared launch holds at most %d", off, BLOCK_BYTES);
    return NULL;
  }
  Py_INCREF(label);
  self->label = label;
  Py_INCREF(owner);
  self->owner = owner;
  return (PyObject*)self;
}

static void prepared_dealloc(Prepared* self) {
  Py_XDECREF(self->label);
  Py_XDECREF(self->owner);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

static PyObject* prepared_repr(Prepared* self) {
  return PyUnicode_FromFormat("<native launch of %U: grid (%u, %u, %u), block (%u, %u, %u), smem %u, %d params%s>",
                              self->label, self->grid[0], self->grid[1], self->grid[2], self->block[0],
                              self->block[1], self->block[2], self->smem, self->nparams,
                              self->dependent ? ", dependent" : "");
}

/* describe() -> (func, ctx, grid, block, smem, dependent, kinds, label): what the launch does, for a caller that
   replays it elsewhere (the torch op library); the caller keeps this object alive while it uses func. */
static PyObject* prepared_describe(Prepared* self, PyObject* unused) {
  (void)unused;
  return Py_BuildValue("KK(III)(III)Iis#O", (unsigned long long)(uintptr_t)self->func,
                       (unsigned long long)(uintptr_t)self->ctx, self->grid[0], self->grid[1], self->grid[2],
                       self->block[0], self->block[1], self->block[2], self->smem, self->dependent, self->kinds,
                       (Py_ssize_t)self->nparams, self->label);
}

static PyMethodDef prepared_methods[] = {
    {"describe", (PyCFunction)prepared_describe, METH_NOARGS,
     "(func, ctx, grid, block, smem, dependent, kinds, label) of this prepared launch"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PreparedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rtckern_native_launch.Prepared",
    .tp_basicsize = sizeof(Prepared),
    .tp_dealloc = (destructor)prepared_dealloc,
    .tp_vectorcall_offset = offsetof(Prepared, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)prepared_repr,
    .tp_methods = prepared_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = prepared_new,
};

/* init(libcuda_path, LaunchError): find the driver entry points in the already loaded libcuda. */
static PyObject* init(PyObject* mod, PyObject* args) {
  const char* path;
  PyObject* err_cls;
  if (!PyArg_ParseTuple(args, "sO", &path, &err_cls)) return NULL;
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (h == NULL) h = dlopen(path, RTLD_NOW);
  if (h == NULL) {
    PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
    return NULL;
  }
  cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
  cu_launch_ex = (launch_ex_fn)dlsym(h, "cuLaunchKernelEx");
  cu_ctx_get = (ctx_get_fn)dlsym(h, "cuCtxGetCurrent");
  cu_ctx_push = (ctx_push_fn)dlsym(h, "cuCtxPushCurrent_v2");
  cu_ctx_pop = (ctx_pop_fn)dlsym(h, "cuCtxPopCurrent_v2");
  cu_error_name = (error_name_fn)dlsym(h, "cuGetErrorName");
  if (!cu_launch || !cu_ctx_get || !cu_ctx_push || !cu_ctx_pop) {
    cu_launch = NULL;
    PyErr_Format(PyExc_OSError, "%s lacks cuLaunchKernel / cuCtxGetCurrent / cuCtxPushCurrent_v2", path);
    return NULL;
  }
  Py_XINCREF(err_cls);
  Py_XSETREF(launch_error, err_cls);
  Py_RETURN_NONE;
}

static PyObject* record(PyObject* mod, PyObject* arg) {
  (void)mod;
  if (arg != Py_None && !PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "record(list or None)");
    return NULL;
  }
  if (arg != Py_None && recorder != NULL && recorder_thread != PyThread_get_thread_ident()) {
    PyErr_SetString(PyExc_RuntimeError, "another thread is recording launches");
    return NULL;
  }
  Py_XDECREF(recorder);
  recorder = arg == Py_None ? NULL : arg;
  Py_XINCREF(recorder);
  recorder_thread = PyThread_get_thread_ident();
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"init", init, METH_VARARGS, "init(libcuda_path, error_class)"},
                                {"record", record, METH_O, "record(list): this thread's launches append (prepared, "
                                                           "args) to list until record(None)"},
                                {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "rtckern_native_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_rtckern_native_launch(void) {
  if (PyType_Ready(&PreparedType) < 0) return NULL;
  PyObject* m = PyModule_Create(&moddef);
  if (m == NULL) return NULL;
  Py_INCREF(&PreparedType);
  if (PyModule_AddObject(m, "Prepared", (PyObject*)&PreparedType) < 0) {
    Py_DECREF(&PreparedType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
