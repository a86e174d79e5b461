// See unpickle.h. Each opcode does what CPython's C unpickler (Modules/_pickle.c) does for it,
// with the reference's hooks (zerofast/load/unpickle.py) in place: globals resolve through the
// reference's own resolver, storages are checked and cut out of the mapping as
// _Storages.__call__ does, and tensors are rebuilt as _rebuild_tensor does. Where an opcode or
// a callee could do something the reference would do differently, or anything fails, the
// reader declines rather than guess.
#include "unpickle.h"

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dlpack_tensor.h"
#include "opcodes.h"
#include "pickle_scan.h"
#include "py_own.h"
#include "recipes.h"
#include "restride.h"
#include "torch_kit.h"
#include "zip_directory.h"

namespace py = pybind11;

namespace zerofast::load {
namespace {

constexpr int64_t kInt64Max = INT64_MAX;
constexpr int kMaxTupleDepth = 3;  // native tuples inside native tuples, at most

// The reference's objects, by identity, and its two callbacks (see native_reader.py).
struct Hooks {
  PyObject* resolve;         // (module, name) -> the allowlisted object, or raises
  PyObject* storage_offset;  // (key, nbytes) -> file offset of that storage, or raises
  const ZipDirectory* zip;   // or, where that hook is a native ZipDirectory, looked up here
  PyObject* rebuild_tensor;
  PyObject* rebuild_parameter;
  PyObject* from_type_v2;
  PyObject* tensor_type;   // what the name torch.Tensor resolves to
  PyObject* storage_type;  // the class of what torch.FloatStorage & co resolve to
  PyObject* record_type;   // stand_ins.DeepSpeedRecord
  PyObject* ordered_dict;
  int64_t byte_limit;      // bytes all the file's tensors may hold together
};

// One stack or memo slot: a Python object, a storage reference (native), a tuple kept native
// (its items in the reader's arena: made a Python tuple only when something other than a
// rebuild, a storage reference or torch.Size takes it, and never where it holds a storage), or
// an empty OrderedDict not made yet (`lazy`: a tensor's backward hooks, which the rebuild drops),
// or a tensor that shares its storage, made with the next batch (`view`: see Reader::flush).
// Owns its reference by hand: pybind11's handles check the GIL on every copy, and the stack
// and memo copy a value per opcode.
struct Val {
  PyObject* obj = nullptr;
  int32_t storage = -1;
  int32_t tuple = -1;
  int32_t lazy = -1;
  int32_t view = -1;

  Val() = default;
  explicit Val(PyObject* owned) : obj(owned) {}
  Val(const Val& o) : obj(o.obj), storage(o.storage), tuple(o.tuple), lazy(o.lazy), view(o.view) { Py_XINCREF(obj); }
  Val(Val&& o) noexcept : obj(o.obj), storage(o.storage), tuple(o.tuple), lazy(o.lazy), view(o.view) {
    o.obj = nullptr;
  }
  Val& operator=(Val o) noexcept {
    std::swap(obj, o.obj);
    storage = o.storage, tuple = o.tuple, lazy = o.lazy, view = o.view;
    return *this;
  }
  ~Val() { Py_XDECREF(obj); }
  static Val of_storage(int32_t i) { Val v; v.storage = i; return v; }
  static Val of_tuple(int32_t i) { Val v; v.tuple = i; return v; }
  static Val of_lazy(int32_t i) { Val v; v.lazy = i; return v; }
  static Val of_view(int32_t i) { Val v; v.view = i; return v; }
};

Val py_val(PyObject* p, const char* what) {
  if (!p) decline_py(what);
  return Val(p);
}

Val borrowed(PyObject* p) {
  Py_INCREF(p);
  return Val(p);
}



// An exact int in [0, 2**63), as the reference's type checks want it.
bool index_value(PyObject* p, int64_t* out) {
  if (!p || !PyLong_CheckExact(p)) return false;
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(p, &overflow);
  if (overflow || x < 0) {
    PyErr_Clear();
    return false;
  }
  *out = x;
  return true;
}

bool index_value(const Val& v, int64_t* out) { return index_value(v.obj, out); }

// A call's arguments, in place: a native tuple's items, or a Python tuple's copied out.
struct Items {
  const Val* data;
  size_t n;
  size_t size() const { return n; }
  bool empty() const { return n == 0; }
  const Val& operator[](size_t i) const { return data[i]; }
};

// What _plain accepts by type alone (stand_ins._PLAIN): None, bool, int, float, str, exactly.
bool plain_scalar(PyObject* v) {
  PyTypeObject* t = Py_TYPE(v);
  return v == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type || t == &PyUnicode_Type;
}

bool dunder(PyObject* key) {  // key.startswith("__") of an exact str
  return PyUnicode_GET_LENGTH(key) >= 2 && PyUnicode_READ_CHAR(key, 0) == '_' && PyUnicode_READ_CHAR(key, 1) == '_';
}


class Reader {
 public:
  // `recipes`: where to note what each tensor is made from (a template's read), or null.
  Reader(const uint8_t* data, size_t n, PyObject* mapping, int64_t mapping_bytes, const Hooks& hooks, ScanFacts facts,
         Recipes* recipes)
      : data_(data), n_(n), mapping_(mapping), mapping_bytes_(mapping_bytes), kit_(bound_kit()), hooks_(hooks),
        recipes_(recipes),
        record_setstate_(own(PyObject_GetAttrString(hooks.record_type, "__setstate__"), "__setstate__")),
        memo_slot_(std::move(facts.memo_slot)) {
    memo_.resize(size_t(facts.memo_slots));
    tuples_.reserve(facts.tuples);
    tuple_items_.reserve(facts.tuple_items);
    views_.reserve(facts.calls);  // a tensor is one REDUCE
    inserts_.reserve(facts.dict_items);
  }

  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  py::object run() {
    for (;;) {
      uint8_t op = *take(1);
      if (op == STOP) {
        Val result = pop();
        if (pos_ != n_) throw Declined("bytes after STOP");
        flush();
        return py::reinterpret_borrow<py::object>(to_py(result));
      }
      step(op);
    }
  }

 private:
  // A storage class as read once, and what its dtype's tensors are made with.
  struct Kind {
    Val kind;
    const DtypeInfo* dtype;
  };
  struct Stored {
    size_t kind;  // in kinds_
    int64_t numel;
    int64_t nbytes;
    int64_t at;    // its bytes' offset in the mapping
    Val first;     // the tensor made over the whole entry through DLPack, whose storage it is
    Val base;      // the batched tensors' base: `first`, else one over mapping[at:at + nbytes]
  };

  const uint8_t* data_;
  size_t n_;
  size_t pos_ = 0;
  PyObject* mapping_;  // the file's UntypedStorage (the caller keeps it alive)
  int64_t mapping_bytes_;
  MappingImports imports_{mapping_};  // the DLPack tensors over the mapping
  const TorchKit& kit_;
  const Hooks& hooks_;
  Recipes* recipes_;
  std::vector<Recipe> view_recipes_;  // the batch's, while recipes_ is set (dims in view_dims_)
  std::vector<int64_t> view_dims_;
  py::object record_setstate_;  // DeepSpeedRecord.__setstate__, the stand-ins' own
  std::vector<Val> stack_;
  // The memo: only the values some GET reads, each in its slot (see ScanFacts::memo_slot).
  // memo_len_ is the memo's length as CPython counts it, for MEMOIZE and the index checks.
  std::vector<Val> memo_;
  std::vector<int32_t> memo_slot_;
  size_t memo_len_ = 0;
  std::vector<size_t> marks_;
  std::vector<Val> tuple_items_;  // every native tuple's items, one after another
  struct Tuple {
    size_t first, count;  // its items in tuple_items_
    bool native;          // holds a storage reference, however deep: never a Python tuple
    int depth;            // 1 + the deepest native tuple among its items: how far making it recurses
    Val made;             // its Python tuple once made: one object, however often it is taken
  };
  std::vector<Tuple> tuples_;
  std::vector<Val> lazies_;  // the empty OrderedDicts once made: one object per REDUCE, shared
  std::vector<Stored> storages_;
  std::vector<int32_t> by_number_;  // storage index by numbered key (see ZipDirectory::numbered)
  std::unordered_map<std::string, int32_t> by_key_;  // by any other key
  std::vector<Kind> kinds_;  // storage classes met so far
  std::vector<std::pair<Val, bool>> setstate_;  // stand-in class -> whether its __setstate__ is the default
  int64_t built_bytes_ = 0;
  // The tensors that share a storage are made in batches (flush), one zerofast::restrided call
  // each, instead of a Tensor.new and a Tensor.set_ through Python apiece (about 1.4 us each,
  // most of a 20k-tensor model-states file's time). A batch is made when something needs one of
  // its tensors as a Python object, before any Python code that could see the unpickled objects
  // runs, and at STOP. Until then the items set into dicts wait too (inserts_), in their order.
  std::vector<Val> views_;  // by view index: null until its batch is made
  size_t views_made_ = 0;   // views_[:views_made_] are made
  RestrideBatch batch_;  // views_[views_made_:], to be made
  struct Insert {
    Val dict, key, value;
  };
  std::vector<Insert> inserts_;

  // -- input and stack, with CPython's underflow rules -------------------------------------
  const uint8_t* take(size_t width) {
    if (width > n_ - pos_) throw Declined("truncated");
    const uint8_t* at = data_ + pos_;
    pos_ += width;
    return at;
  }
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  Val pop() {
    if (stack_.size() <= fence()) throw Declined("stack underflow");
    Val v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  Val& top() {
    if (stack_.size() <= fence()) throw Declined("stack underflow");
    return stack_.back();
  }
  size_t marker() {
    if (marks_.empty()) throw Declined("no MARK");
    size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  // A Python object (borrowed: `v` or the reader holds it), making a lazy one now.
  PyObject* to_py(const Val& v) {
    if (v.obj) return v.obj;
    if (v.view >= 0) {
      if (!views_[size_t(v.view)].obj) flush();
      return views_[size_t(v.view)].obj;
    }
    if (v.lazy >= 0) {
      Val& made = lazies_[size_t(v.lazy)];
      if (!made.obj) made = py_val(PyObject_CallNoArgs(hooks_.ordered_dict), "OrderedDict");
      return made.obj;
    }
    if (v.tuple < 0 || tuples_[size_t(v.tuple)].native)
      throw Declined("a storage reference where a Python object is expected");
    if (!tuples_[size_t(v.tuple)].made.obj) {
      const Tuple t = {tuples_[size_t(v.tuple)].first, tuples_[size_t(v.tuple)].count, false, 0, Val()};
      Val made = py_val(PyTuple_New(Py_ssize_t(t.count)), "tuple");
      for (size_t i = 0; i < t.count; ++i) {
        PyObject* item = to_py(tuple_items_[t.first + i]);  // recurses at most kMaxTupleDepth deep
        Py_INCREF(item);
        PyTuple_SET_ITEM(made.obj, Py_ssize_t(i), item);
      }
      tuples_[size_t(v.tuple)].made = std::move(made);
    }
    return tuples_[size_t(v.tuple)].made.obj;
  }
  bool holds_storage(const Val& v) const {
    return v.storage >= 0 || (v.tuple >= 0 && tuples_[size_t(v.tuple)].native);
  }
  int depth_of(const Val& v) const { return v.tuple >= 0 && !v.obj ? tuples_[size_t(v.tuple)].depth : 0; }
  // The stack from `start` on, taken off it as one native tuple. A Python-able item nested too
  // deep is made a Python object first, so making this one later recurses a bounded depth.
  Val tuple_from(size_t start) {
    bool native = false;
    int depth = 0;
    for (size_t i = start; i < stack_.size(); ++i) {
      if (!holds_storage(stack_[i]) && depth_of(stack_[i]) >= kMaxTupleDepth) stack_[i] = borrowed(to_py(stack_[i]));
      native = native || holds_storage(stack_[i]);
      depth = std::max(depth, depth_of(stack_[i]));
    }
    tuples_.push_back(Tuple{tuple_items_.size(), stack_.size() - start, native, depth + 1, Val()});
    tuple_items_.insert(tuple_items_.end(), std::make_move_iterator(stack_.begin() + start),
                        std::make_move_iterator(stack_.end()));
    stack_.resize(start);
    return Val::of_tuple(int32_t(tuples_.size() - 1));
  }
  // A call's argument tuple: a native one in place, a Python one's items copied to `scratch`.
  // (Valid until the next native tuple is made.)
  Items items_of(const Val& v, std::vector<Val>& scratch) const {
    if (v.tuple >= 0) {
      const Tuple& t = tuples_[size_t(v.tuple)];
      return Items{tuple_items_.data() + t.first, t.count};
    }
    if (!v.obj || !PyTuple_Check(v.obj)) throw Declined("call arguments are not a tuple");
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v.obj); ++i) scratch.push_back(borrowed(PyTuple_GET_ITEM(v.obj, i)));
    return Items{scratch.data(), scratch.size()};
  }

  void step(uint8_t op);
  void step_containers(uint8_t op);
  void push_sized(uint8_t op);
  void memo_put(uint64_t index);
  void memo_get(uint64_t index);
  py::object line();
  Val resolve(PyObject* module, PyObject* name);
  void append_items(ptrdiff_t x);
  void set_items(ptrdiff_t x);
  void add_items(size_t mark);
  Val reduce(const Val& callee, const Val& args);
  Val make_size(const Val& args);
  Val newobj(const Val& cls, const Val& args);
  void build(const Val& state);
  bool default_setstate(PyTypeObject* type);
  bool set_plain_state(PyObject* inst, PyObject* state);
  Val persistent(const Val& pid);
  size_t kind_of(PyObject* kind);
  int32_t& declared(const char* key, size_t len);
  int64_t storage_offset_py(PyObject* key, int64_t nbytes) const;
  Val rebuild_tensor(const Items& args);
  Val whole_entry(Stored& s, const DtypeInfo& dtype, const Dims& size, const Dims& stride);
  Val defer(int32_t index, int64_t offset, const Dims& size, const Dims& stride);
  void flush();
  void insert(PyObject* target, PyObject* key, PyObject* value);
  Val rebuild_parameter(const Items& args);
  Val rebuild_from_type(const Items& args);
  void dims(const Val& v, Dims* out);
};

void Reader::step(uint8_t op) {
  switch (op) {
    case PROTO: if (*take(1) > 5) throw Declined("unsupported protocol"); return;
    case NONE: stack_.push_back(borrowed(Py_None)); return;
    case NEWTRUE: stack_.push_back(borrowed(Py_True)); return;
    case NEWFALSE: stack_.push_back(borrowed(Py_False)); return;
    case BININT: stack_.push_back(py_val(PyLong_FromLong(int32_t(little(take(4), 4))), "int")); return;
    case BININT1: stack_.push_back(py_val(PyLong_FromLong(long(*take(1))), "int")); return;
    case BININT2: stack_.push_back(py_val(PyLong_FromLong(long(little(take(2), 2))), "int")); return;
    case BINFLOAT: {
      double x = PyFloat_Unpack8(reinterpret_cast<const char*>(take(8)), 0);
      if (x == -1.0 && PyErr_Occurred()) decline_py("float");
      stack_.push_back(py_val(PyFloat_FromDouble(x), "float"));
      return;
    }
    case BINUNICODE: case SHORT_BINUNICODE: case BINUNICODE8:
    case BINBYTES: case SHORT_BINBYTES: case BINBYTES8: case LONG1: push_sized(op); return;
    case MARK: marks_.push_back(stack_.size()); return;
    case BINPUT: memo_put(little(take(1), 1)); return;
    case LONG_BINPUT: memo_put(little(take(4), 4)); return;
    case MEMOIZE: memo_put(memo_len_); return;
    case BINGET: memo_get(little(take(1), 1)); return;
    case LONG_BINGET: memo_get(little(take(4), 4)); return;
    case EMPTY_TUPLE: stack_.push_back(py_val(PyTuple_New(0), "tuple")); return;
    case TUPLE: { size_t m = marker(); Val t = tuple_from(m); stack_.push_back(std::move(t)); return; }
    case TUPLE1: case TUPLE2: case TUPLE3: {
      size_t k = op - TUPLE1 + 1;
      if (stack_.size() < fence() + k) throw Declined("stack underflow");
      Val t = tuple_from(stack_.size() - k);
      stack_.push_back(std::move(t));
      return;
    }
    case BINPERSID: { Val pid = pop(); stack_.push_back(persistent(pid)); return; }
    case REDUCE: { Val args = pop(); Val callee = pop(); stack_.push_back(reduce(callee, args)); return; }
    case NEWOBJ: { Val args = pop(); Val cls = pop(); stack_.push_back(newobj(cls, args)); return; }
    case BUILD: { Val state = pop(); build(state); return; }
    case GLOBAL: {
      py::object module = line();
      py::object name = line();
      stack_.push_back(resolve(module.ptr(), name.ptr()));
      return;
    }
    case STACK_GLOBAL: {
      Val name = pop(), module = pop();
      if (!name.obj || !module.obj || !PyUnicode_CheckExact(name.obj) || !PyUnicode_CheckExact(module.obj))
        throw Declined("STACK_GLOBAL needs two str");
      stack_.push_back(resolve(module.obj, name.obj));
      return;
    }
    default: step_containers(op);
  }
}

void Reader::step_containers(uint8_t op) {
  switch (op) {
    case EMPTY_LIST: stack_.push_back(py_val(PyList_New(0), "list")); return;
    case EMPTY_DICT: stack_.push_back(py_val(PyDict_New(), "dict")); return;
    case EMPTY_SET: stack_.push_back(py_val(PySet_New(nullptr), "set")); return;
    case LIST: {
      size_t m = marker();
      Val list = py_val(PyList_New(Py_ssize_t(stack_.size() - m)), "list");
      for (size_t i = m; i < stack_.size(); ++i) {
        PyObject* item = to_py(stack_[i]);
        Py_INCREF(item);
        PyList_SET_ITEM(list.obj, Py_ssize_t(i - m), item);
      }
      stack_.resize(m);
      stack_.push_back(std::move(list));
      return;
    }
    case DICT: {
      size_t m = marker();
      if ((stack_.size() - m) % 2) throw Declined("odd number of items for DICT");
      Val dict = py_val(PyDict_New(), "dict");
      for (size_t i = m; i < stack_.size(); i += 2)
        if (PyDict_SetItem(dict.obj, to_py(stack_[i]), to_py(stack_[i + 1])) < 0) decline_py("dict item");
      stack_.resize(m);
      stack_.push_back(std::move(dict));
      return;
    }
    case FROZENSET: {
      Val items = tuple_from(marker());
      stack_.push_back(py_val(PyFrozenSet_New(to_py(items)), "frozenset"));
      return;
    }
    case APPEND: append_items(ptrdiff_t(stack_.size()) - 1); return;
    case APPENDS: append_items(ptrdiff_t(marker())); return;
    case SETITEM: set_items(ptrdiff_t(stack_.size()) - 2); return;
    case SETITEMS: set_items(ptrdiff_t(marker())); return;
    case ADDITEMS: add_items(marker()); return;
    case POP:
      if (!marks_.empty() && marks_.back() == stack_.size()) marks_.pop_back();
      else pop();
      return;
    case POP_MARK: stack_.resize(marker()); return;
    case DUP: { Val v = top(); stack_.push_back(std::move(v)); return; }
    default: throw Declined("opcode outside the native subset");
  }
}

void Reader::push_sized(uint8_t op) {
  int width = (op == BINUNICODE || op == BINBYTES) ? 4 : (op == BINUNICODE8 || op == BINBYTES8) ? 8 : 1;
  uint64_t size = little(take(width), width);
  if (size > uint64_t(PY_SSIZE_T_MAX)) throw Declined("length too large");
  const char* s = reinterpret_cast<const char*>(take(size_t(size)));
  Py_ssize_t len = Py_ssize_t(size);
  if (op == LONG1) {
    PyObject* v = len ? _PyLong_FromByteArray(reinterpret_cast<const unsigned char*>(s), size_t(len), 1, 1)
                      : PyLong_FromLong(0);
    stack_.push_back(py_val(v, "int"));
  } else if (op == BINBYTES || op == SHORT_BINBYTES || op == BINBYTES8) {
    stack_.push_back(py_val(PyBytes_FromStringAndSize(s, len), "bytes"));
  } else {
    stack_.push_back(py_val(PyUnicode_DecodeUTF8(s, len, "surrogatepass"), "str"));
  }
}

// The bounds pass walked these very opcodes with the same rules, so it saw every index put:
// memo_len_ <= memo_slot_.size() always, and a GET's index always has a slot.
void Reader::memo_put(uint64_t index) {
  const Val& value = top();
  if (index > memo_len_) throw Declined("memo index runs ahead");
  if (index >= memo_slot_.size()) throw Declined("memo index the bounds pass did not see");
  if (index == memo_len_) ++memo_len_;
  if (memo_slot_[index] >= 0) memo_[size_t(memo_slot_[index])] = value;  // only what a GET reads
}

void Reader::memo_get(uint64_t index) {
  if (index >= memo_len_) throw Declined("memo value not found");
  if (memo_slot_[index] < 0) throw Declined("memo GET the bounds pass did not see");
  stack_.push_back(memo_[size_t(memo_slot_[index])]);
}

py::object Reader::line() {  // one text argument of GLOBAL, decoded as CPython does
  const void* nl = std::memchr(data_ + pos_, '\n', n_ - pos_);
  if (!nl) throw Declined("truncated line");
  size_t len = static_cast<const uint8_t*>(nl) - (data_ + pos_);
  if (len < 1) throw Declined("empty GLOBAL line");
  const char* s = reinterpret_cast<const char*>(take(len + 1));
  return own(PyUnicode_DecodeUTF8(s, Py_ssize_t(len), "strict"), "global name");
}

Val Reader::resolve(PyObject* module, PyObject* name) {
  return py_val(PyObject_CallFunctionObjArgs(hooks_.resolve, module, name, nullptr), "global off the allowlist");
}

void Reader::append_items(ptrdiff_t x) {
  ptrdiff_t len = ptrdiff_t(stack_.size());
  if (x > len || x <= ptrdiff_t(fence())) throw Declined("stack underflow");
  if (x == len) return;
  PyObject* list = to_py(stack_[x - 1]);
  if (!PyList_CheckExact(list)) throw Declined("APPEND to something other than a list");
  for (size_t i = size_t(x); i < stack_.size(); ++i)
    if (PyList_Append(list, to_py(stack_[i])) < 0) decline_py("append");
  stack_.resize(size_t(x));
}

void Reader::set_items(ptrdiff_t x) {
  ptrdiff_t len = ptrdiff_t(stack_.size());
  if (x > len || x <= ptrdiff_t(fence())) throw Declined("stack underflow");
  if (x == len) return;
  if ((len - x) % 2) throw Declined("odd number of items for SETITEMS");
  PyObject* target = to_py(stack_[x - 1]);
  if (!PyDict_CheckExact(target) && Py_TYPE(target) != reinterpret_cast<PyTypeObject*>(hooks_.ordered_dict))
    throw Declined("SETITEM on something other than a dict");
  for (size_t i = size_t(x); i < stack_.size(); i += 2) {
    PyObject* k = to_py(stack_[i]);
    // While a batch is open, items keyed by an exact str (whose hash and equality run no
    // Python code) wait for it: a state dict's tensors are then made in one call.
    if (views_made_ < views_.size() && PyUnicode_CheckExact(k)) {
      inserts_.push_back(Insert{borrowed(target), borrowed(k), stack_[i + 1]});
      continue;
    }
    flush();
    insert(target, k, to_py(stack_[i + 1]));
  }
  stack_.resize(size_t(x));
}

void Reader::add_items(size_t mark) {
  if (mark > stack_.size() || mark <= fence()) throw Declined("stack underflow");
  if (mark == stack_.size()) return;
  PyObject* target = to_py(stack_[mark - 1]);
  if (!PySet_Check(target)) throw Declined("ADDITEMS to something other than a set");
  for (size_t i = mark; i < stack_.size(); ++i)
    if (PySet_Add(target, to_py(stack_[i])) < 0) decline_py("set item");
  stack_.resize(mark);
}

Val Reader::reduce(const Val& callee, const Val& args) {
  PyObject* f = to_py(callee);
  std::vector<Val> scratch;
  if (f == hooks_.rebuild_tensor) return rebuild_tensor(items_of(args, scratch));
  if (f == hooks_.rebuild_parameter) return rebuild_parameter(items_of(args, scratch));
  if (f == hooks_.from_type_v2) return rebuild_from_type(items_of(args, scratch));
  // Any other allowlisted object (OrderedDict, set, torch.Size, a stand-in), called as the C
  // unpickler calls it; what is not callable fails and declines.
  if (f == kit_.size_type && args.tuple >= 0 && !holds_storage(args)) return make_size(args);
  bool empty = args.tuple >= 0 && !args.obj && tuples_[size_t(args.tuple)].count == 0;
  PyObject* a = to_py(args);
  if (!PyTuple_Check(a)) throw Declined("REDUCE arguments are not a tuple");
  if (f == hooks_.ordered_dict && (empty || (PyTuple_CheckExact(a) && PyTuple_GET_SIZE(a) == 0))) {
    lazies_.emplace_back();  // made only if something other than a tensor rebuild takes it
    return Val::of_lazy(int32_t(lazies_.size() - 1));
  }
  flush();  // the callee could look into a dict whose items still wait for their batch
  return py_val(PyObject_CallObject(f, a), "call");
}

Val Reader::make_size(const Val& args) {
  // torch.Size(t) of a tuple of exact ints is a torch.Size holding t's very items (its
  // constructor copies them and checks each is an int); anything else goes through the call.
  std::vector<Val> scratch, inner;
  Items outer = items_of(args, scratch);
  const Val* dims = outer.size() == 1 ? &outer[0] : nullptr;
  bool plain = dims && ((dims->tuple >= 0 && !holds_storage(*dims)) || (dims->obj && PyTuple_CheckExact(dims->obj)));
  Items items = plain ? items_of(*dims, inner) : Items{nullptr, 0};
  for (size_t i = 0; plain && i < items.size(); ++i) plain = items[i].obj && PyLong_CheckExact(items[i].obj);
  if (!plain) {
    flush();
    return py_val(PyObject_CallObject(kit_.size_type, to_py(args)), "call");
  }
  auto* size_type = reinterpret_cast<PyTypeObject*>(kit_.size_type);
  Val size = py_val(size_type->tp_alloc(size_type, Py_ssize_t(items.size())), "torch.Size");
  for (size_t i = 0; i < items.size(); ++i) {
    Py_INCREF(items[i].obj);
    PyTuple_SET_ITEM(size.obj, Py_ssize_t(i), items[i].obj);
  }
  return size;
}

Val Reader::newobj(const Val& cls, const Val& args) {
  // Only the stand-ins' classes: DeepSpeed's objects are pickled this way, nothing else is.
  flush();
  PyObject *c = to_py(cls), *a = to_py(args);
  if (!PyType_Check(c) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(c),
                                            reinterpret_cast<PyTypeObject*>(hooks_.record_type)))
    throw Declined("NEWOBJ of something other than a stand-in");
  if (!PyTuple_Check(a)) throw Declined("NEWOBJ arguments are not a tuple");
  auto* type = reinterpret_cast<PyTypeObject*>(c);
  return py_val(type->tp_new(type, a, nullptr), "NEWOBJ");
}

void Reader::build(const Val& state) {
  // Only on a stand-in, whose __setstate__ checks the state, or on an OrderedDict given a dict
  // (a state_dict's `_metadata`). BUILD on anything else (a tensor, an allowlisted function)
  // could change it, and the reference's check after loading is not repeated here.
  flush();
  PyObject* inst = to_py(top());
  PyObject* s = to_py(state);
  if (PyObject_TypeCheck(inst, reinterpret_cast<PyTypeObject*>(hooks_.record_type))) {
    if (set_plain_state(inst, s)) return;
    py::object setstate = own(PyObject_GetAttrString(inst, "__setstate__"), "__setstate__");
    own(PyObject_CallOneArg(setstate.ptr(), s), "__setstate__");
    return;
  }
  if (Py_TYPE(inst) != reinterpret_cast<PyTypeObject*>(hooks_.ordered_dict) || !PyDict_CheckExact(s) ||
      PyObject_HasAttrString(inst, "__setstate__"))
    throw Declined("BUILD on something other than a stand-in or a state dict");
  // What the C unpickler does without __setstate__: the state goes into the instance's
  // __dict__, keys interned.
  py::object dict = own(PyObject_GetAttrString(inst, "__dict__"), "__dict__");
  Py_ssize_t i = 0;
  PyObject *key, *value;
  while (PyDict_Next(s, &i, &key, &value)) {
    Py_INCREF(key);
    if (PyUnicode_CheckExact(key)) PyUnicode_InternInPlace(&key);
    int failed = PyObject_SetItem(dict.ptr(), key, value);
    Py_DECREF(key);
    if (failed < 0) decline_py("state item");
  }
}

bool Reader::default_setstate(PyTypeObject* type) {
  PyObject* cls = reinterpret_cast<PyObject*>(type);
  for (const auto& [t, yes] : setstate_)
    if (t.obj == cls) return yes;
  py::object method = own(PyObject_GetAttrString(cls, "__setstate__"), "__setstate__");
  setstate_.emplace_back(borrowed(cls), method.ptr() == record_setstate_.ptr());
  return setstate_.back().second;
}

// DeepSpeedRecord.__setstate__(state) without the call, where its checks (_check_fields) pass
// by type alone: `state` an exact dict, every key an exact str not starting with "__", every
// value of one of _PLAIN's types exactly. Anything else (a tuple state, a nested value, a
// refusal) is left to the method itself: false.
bool Reader::set_plain_state(PyObject* inst, PyObject* state) {
  if (!PyDict_CheckExact(state) || !default_setstate(Py_TYPE(inst))) return false;
  Py_ssize_t i = 0;
  PyObject *key, *value;
  while (PyDict_Next(state, &i, &key, &value))
    if (!PyUnicode_CheckExact(key) || dunder(key) || !plain_scalar(value)) return false;
  py::object dict = own(PyObject_GenericGetDict(inst, nullptr), "__dict__");  // self.__dict__
  if (PyDict_Update(dict.ptr(), state) < 0) decline_py("state");
  return true;
}

size_t Reader::kind_of(PyObject* kind) {  // kind.dtype, and what its tensors are made with
  for (size_t i = 0; i < kinds_.size(); ++i)
    if (kinds_[i].kind.obj == kind) return i;
  Val dtype = py_val(PyObject_GetAttrString(kind, "dtype"), "storage dtype");
  if (Py_TYPE(dtype.obj) != reinterpret_cast<PyTypeObject*>(kit_.dtype_type)) throw Declined("storage dtype");
  kinds_.push_back(Kind{borrowed(kind), &dtype_info(dtype.obj)});
  return kinds_.size() - 1;
}

int32_t& Reader::declared(const char* key, size_t len) {  // the storage index of `key`, -1 if new
  if (hooks_.zip) {
    int64_t n = numbered_key(key, len, hooks_.zip->numbered.size());
    if (n >= 0) {
      if (by_number_.empty()) by_number_.assign(hooks_.zip->numbered.size(), -1);
      return by_number_[size_t(n)];
    }
  }
  return by_key_.try_emplace(std::string(key, len), -1).first->second;
}

Val Reader::persistent(const Val& pid) {  // _Storages.__call__
  if (holds_storage(pid) || !(pid.tuple >= 0 || (pid.obj && PyTuple_Check(pid.obj)))) throw Declined("not a storage reference");
  std::vector<Val> scratch;
  Items p = items_of(pid, scratch);
  if (p.size() != 5 || !p[0].obj || !p[1].obj || !p[2].obj) throw Declined("not a storage reference");
  PyObject *tag = p[0].obj, *kind = p[1].obj, *key = p[2].obj;
  int64_t numel = 0;
  if (!PyUnicode_CheckExact(tag) || PyUnicode_CompareWithASCIIString(tag, "storage") != 0 ||
      Py_TYPE(kind) != reinterpret_cast<PyTypeObject*>(hooks_.storage_type) || !PyUnicode_Check(key) ||
      !index_value(p[4], &numel))
    throw Declined("not a storage reference");
  size_t k = kind_of(kind);
  __int128 nbytes128 = __int128(numel) * kinds_[k].dtype->itemsize;
  if (nbytes128 > kInt64Max) throw Declined("storage too large");
  int64_t nbytes = int64_t(nbytes128);
  Py_ssize_t key_len = 0;
  const char* key_utf8 = PyUnicode_AsUTF8AndSize(key, &key_len);
  if (!key_utf8) decline_py("storage key");
  int32_t& index = declared(key_utf8, size_t(key_len));
  if (index >= 0) {
    const Stored& s = storages_[size_t(index)];
    if (s.nbytes != nbytes || kinds_[s.kind].dtype != kinds_[k].dtype)
      throw Declined("storage declared twice differently");
    return Val::of_storage(index);
  }
  int64_t offset = hooks_.zip ? hooks_.zip->storage_offset(key_utf8, size_t(key_len), nbytes)
                              : storage_offset_py(key, nbytes);
  if (offset < 0 || offset > mapping_bytes_ - nbytes) throw Declined("storage outside the mapping");
  storages_.push_back({k, numel, nbytes, offset, Val(), Val()});
  index = int32_t(storages_.size() - 1);
  return Val::of_storage(index);
}

int64_t Reader::storage_offset_py(PyObject* key, int64_t nbytes) const {  // the reference's own lookup
  py::object nb = own(PyLong_FromLongLong(nbytes), "int");
  py::object at = own(PyObject_CallFunctionObjArgs(hooks_.storage_offset, key, nb.ptr(), nullptr), "storage entry");
  int64_t offset = -1;
  return index_value(at.ptr(), &offset) ? offset : -1;
}

void Reader::dims(const Val& v, Dims* out) {  // _dims
  if (v.tuple >= 0 && !v.obj) {
    if (holds_storage(v)) throw Declined("sizes are not a tuple");
    std::vector<Val> scratch;
    Items items = items_of(v, scratch);
    if (items.size() > kMaxDims) throw Declined("too many dimensions");
    for (size_t i = 0; i < items.size(); ++i) {
      int64_t d = 0;
      if (!index_value(items[i], &d)) throw Declined("a size is not an int in [0, 2**63)");
      out->v[out->n++] = d;
    }
    return;
  }
  PyObject* p = to_py(v);
  bool tuple = PyTuple_Check(p);
  if (!tuple && !PyList_Check(p)) throw Declined("sizes are not a tuple");
  Py_ssize_t n = tuple ? PyTuple_GET_SIZE(p) : PyList_GET_SIZE(p);
  if (size_t(n) > kMaxDims) throw Declined("too many dimensions");
  for (Py_ssize_t i = 0; i < n; ++i) {
    int64_t d = 0;
    if (!index_value(tuple ? PyTuple_GET_ITEM(p, i) : PyList_GET_ITEM(p, i), &d))
      throw Declined("a size is not an int in [0, 2**63)");
    out->v[out->n++] = d;
  }
}

Val Reader::rebuild_tensor(const Items& args) {  // _rebuild_tensor
  if (args.size() < 4 || args[0].storage < 0) throw Declined("not a tensor rebuild");
  Stored& s = storages_[args[0].storage];
  int64_t offset = 0;
  Dims size, stride;
  if (!index_value(args[1], &offset)) throw Declined("storage offset");
  dims(args[2], &size);
  dims(args[3], &stride);
  if (size.size() != stride.size()) throw Declined("sizes and strides differ in length");
  // Saturating: any value past the storage fails the checks below, however far past.
  const __int128 limit = __int128(kInt64Max) + 1;
  __int128 numel = 1, extent = __int128(offset) + 1;
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    numel = std::min(numel * size[i], limit);
    extent = std::min(extent + std::min(__int128(size[i] ? size[i] - 1 : 0) * stride[i], limit), limit);
    empty = empty || size[i] == 0;
  }
  if (empty) extent = 0;
  // Overlapping strides would let a small file demand terabytes once anything copies it.
  if (numel > s.numel || extent > s.numel) throw Declined("a tensor past its storage");
  const DtypeInfo& dtype = *kinds_[s.kind].dtype;
  built_bytes_ += int64_t(numel) * dtype.itemsize;
  if (built_bytes_ > hooks_.byte_limit) throw Declined("too many bytes of tensors");
  // The storage's first tensor, at offset 0 and reaching its last element (or an empty one over
  // an empty entry: ZeRO-3's placeholders): one DLPack import makes both, its storage then
  // holding exactly the entry's bytes, as the reference's does.
  if (dtype.dl && offset == 0 && extent == s.numel && !s.base.obj && !s.first.obj)
    return whole_entry(s, dtype, size, stride);
  return defer(args[0].storage, offset, size, stride);
}

// A tensor over storage `index` (checked to lie inside it), made with the next batch.
Val Reader::defer(int32_t index, int64_t offset, const Dims& size, const Dims& stride) {
  Stored& s = storages_[size_t(index)];
  if (!s.base.obj && s.first.obj) s.base = s.first;  // the storage's own tensor
  if (!s.base.obj) {  // else one over the entry, cut as the reference cuts it
    py::object storage = cut(mapping_, s.at, s.nbytes);
    s.base = Val(whole_storage_tensor(*kinds_[s.kind].dtype, storage.ptr(), s.numel).release().ptr());
  }
  batch_.add(s.base.obj, offset, size.size(), size.v, stride.v);
  if (recipes_) {
    view_recipes_.push_back(Recipe{s.at, s.nbytes, kinds_[s.kind].dtype, offset, size.size(), view_dims_.size()});
    view_dims_.insert(view_dims_.end(), size.v, size.v + size.size());
    view_dims_.insert(view_dims_.end(), stride.v, stride.v + stride.size());
  }
  views_.emplace_back();
  return Val::of_view(int32_t(views_.size() - 1));
}

// Makes the batch: every tensor defer() left, in one zerofast::restrided call.
void Reader::flush() {
  if (views_made_ == views_.size()) return;  // then no item waits either
  const size_t count = views_.size() - views_made_;
  py::object made = batch_.make();
  for (size_t i = 0; i < count; ++i) views_[views_made_ + i] = borrowed(PyList_GET_ITEM(made.ptr(), Py_ssize_t(i)));
  for (size_t i = 0; recipes_ && i < view_recipes_.size(); ++i) {
    const Recipe& r = view_recipes_[i];
    recipes_->add(views_[views_made_ + i].obj, r, view_dims_.data() + r.dims_at, view_dims_.data() + r.dims_at + r.ndim);
  }
  view_recipes_.clear();
  view_dims_.clear();
  views_made_ = views_.size();
  std::vector<Insert> waiting;  // in the order SETITEM met them, as if each were set then
  waiting.swap(inserts_);
  for (const Insert& item : waiting) insert(item.dict.obj, item.key.obj, to_py(item.value));
}

void Reader::insert(PyObject* target, PyObject* key, PyObject* value) {  // a dict or an OrderedDict
  if ((PyDict_CheckExact(target) ? PyDict_SetItem(target, key, value) : PyObject_SetItem(target, key, value)) < 0)
    decline_py("dict item");
}

Val Reader::whole_entry(Stored& s, const DtypeInfo& dtype, const Dims& size, const Dims& stride) {
  s.first = Val(imports_.tensor(dtype, s.at, size.size(), size.v, stride.v).release().ptr());
  if (recipes_) recipes_->add(s.first.obj, Recipe{s.at, s.nbytes, &dtype, 0, size.size(), 0}, size.v, stride.v);
  return s.first;
}

Val Reader::rebuild_parameter(const Items& args) {  // _rebuild_parameter
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(kit_.tensor_type);
  if (!args.empty() && args[0].view >= 0) return args[0];  // a tensor, made with its batch
  if (args.empty() || !args[0].obj || !PyObject_TypeCheck(args[0].obj, tensor_type))
    throw Declined("not a tensor");
  return args[0];
}

Val Reader::rebuild_from_type(const Items& args) {  // _rebuild_from_type_v2
  if (args.size() != 4 || !args[0].obj || !args[1].obj || args[1].obj != hooks_.tensor_type)
    throw Declined("not a plain tensor rebuild");
  PyObject* func = args[0].obj;
  if (args[2].tuple < 0 && !(args[2].obj && PyTuple_Check(args[2].obj))) throw Declined("not a plain tensor rebuild");
  std::vector<Val> scratch;
  if (func == hooks_.rebuild_tensor) return rebuild_tensor(items_of(args[2], scratch));
  if (func == hooks_.rebuild_parameter) return rebuild_parameter(items_of(args[2], scratch));
  throw Declined("not a plain tensor rebuild");
}

Hooks hooks_from(const py::tuple& t) {
  if (t.size() != 10) throw std::invalid_argument("unpickle: expected 10 hooks");
  const ZipDirectory* zip = py::isinstance<ZipDirectory>(t[1]) ? t[1].cast<const ZipDirectory*>() : nullptr;
  return Hooks{t[0].ptr(), t[1].ptr(), zip, t[2].ptr(), t[3].ptr(), t[4].ptr(), t[5].ptr(), t[6].ptr(), t[7].ptr(),
               t[8].ptr(), t[9].cast<int64_t>()};
}

// The mapping's size, asked of the storage itself (its nbytes()).
int64_t mapping_size(PyObject* mapping) {
  return int64_of(call_method(mapping, names().nbytes).ptr(), "mapping size");
}

py::tuple unpickle(const py::bytes& data, const py::object& mapping, const py::tuple& hook_tuple, bool recipes) {
  Hooks hooks = hooks_from(hook_tuple);
  const auto* bytes = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(data.ptr()));
  size_t n = size_t(PyBytes_GET_SIZE(data.ptr()));
  auto noted = recipes ? std::make_shared<Recipes>() : nullptr;
  try {
    ScanFacts facts;
    {
      py::gil_scoped_release unlocked;  // the bounds pass touches no Python object
      facts = scan_pickle(bytes, n);
    }
    Reader reader(bytes, n, mapping.ptr(), mapping_size(mapping.ptr()), hooks, std::move(facts), noted.get());
    py::object result = reader.run();
    if (recipes) return py::make_tuple(true, result, noted);
    return py::make_tuple(true, result);
  } catch (const Declined& e) {
    if (recipes) return py::make_tuple(false, std::string(e.what()), py::none());
    return py::make_tuple(false, std::string(e.what()));
  }
}

// Only the bounds pass, for a pickle the Python unpickler builds (a DCP .metadata of a million
// chunks is a hundred MB, where the Python pass takes about a minute). (True, "") where it
// passes, else (False, why): the Python pass then runs and words the verdict.
py::tuple pickle_bounded(const py::bytes& data) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(data.ptr()));
  size_t n = size_t(PyBytes_GET_SIZE(data.ptr()));
  try {
    py::gil_scoped_release unlocked;  // touches no Python object; `data` is kept alive by the caller
    scan_pickle(bytes, n);
  } catch (const Declined& e) {
    return py::make_tuple(false, std::string(e.what()));
  }
  return py::make_tuple(true, std::string());
}

}  // namespace

void register_unpickle(py::module_& m) {
  py::class_<Recipes, std::shared_ptr<Recipes>>(m, "Recipes",
                                                "What a read made each of its tensors from, for the twin copier");
  m.def("unpickle", &unpickle, py::arg("data"), py::arg("mapping"), py::arg("hooks"), py::arg("recipes") = false,
        "Read a torch.save pickle natively: (True, result), or (False, why) when the Python reader must decide; "
        "with recipes=True a third item, the Recipes of the result's tensors (None when declined)");
  m.def("pickle_bounded", &pickle_bounded, py::arg("data"),
        "The native bounds pass alone: (True, '') where the pickle passes it, else (False, why)");
}

}  // namespace zerofast::load
